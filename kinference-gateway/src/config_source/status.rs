//! `status` of every configuration object, written by the lease holder with server-side apply.
//!
//! For each object of a [`Snapshot`]: `observedGeneration` (the latest generation seen),
//! `activeGeneration` (the one serving) and three conditions: `Accepted` (the latest generation
//! validated), `Ready` (some generation serves) and `RolledBack` (the latest generation was
//! refused: the message names the error and the generation still serving). The printer columns of
//! the CRDs show all three and the serving generation. Only changes are written: the desired status is compared with the status the watch
//! last saw, so a replica taking the lease over writes nothing that is already right.

use std::sync::Arc;

use kube::api::{Patch, PatchParams};
use kube::core::DynamicObject;
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::kube::api_resource;
use super::{ObjectEntry, ObjectState, Snapshot};

/// The field manager of every status write.
pub const FIELD_MANAGER: &str = "kinference-gateway";

fn condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) -> Value {
    let mut c = json!({
        "type": type_,
        "status": if status { "True" } else { "False" },
        "reason": reason,
        "message": message,
        "lastTransitionTime": now_rfc3339(),
    });
    if let Some(g) = generation {
        c["observedGeneration"] = json!(g);
    }
    c
}

/// Now, RFC 3339 in whole seconds (as `metav1.Time`).
fn now_rfc3339() -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    k8s_openapi::jiff::Timestamp::from_second(now.as_second())
        .unwrap_or(now)
        .to_string()
}

/// The status an object should have.
pub fn desired_status(e: &ObjectEntry) -> Value {
    let g = e.observed_generation;
    let (accepted, ready, rolled_back) = match &e.state {
        ObjectState::Accepted => (
            condition(
                "Accepted",
                true,
                "Valid",
                "the latest generation is valid",
                g,
            ),
            condition(
                "Ready",
                true,
                "Serving",
                "the latest generation is serving",
                g,
            ),
            condition(
                "RolledBack",
                false,
                "Current",
                "the latest generation is serving",
                g,
            ),
        ),
        ObjectState::RolledBack {
            error,
            serving_generation,
        } => {
            let serving = serving_generation.map_or("an earlier generation".to_string(), |s| {
                format!("generation {s}")
            });
            (
                condition("Accepted", false, "Invalid", error, g),
                condition(
                    "Ready",
                    true,
                    "PreviousGenerationServing",
                    &format!("{serving} keeps serving"),
                    g,
                ),
                condition(
                    "RolledBack",
                    true,
                    "InvalidGeneration",
                    &format!("{error}; {serving} keeps serving"),
                    g,
                ),
            )
        }
        ObjectState::Rejected { error } => (
            condition("Accepted", false, "Invalid", error, g),
            condition(
                "Ready",
                false,
                "NotServing",
                "no valid generation of this object",
                g,
            ),
            condition(
                "RolledBack",
                false,
                "NoValidGeneration",
                "no earlier valid generation to serve",
                g,
            ),
        ),
        ObjectState::Conflict { error, .. } => (
            condition("Accepted", false, "NameConflict", error, g),
            condition(
                "Ready",
                false,
                "NotServing",
                "another object owns this name",
                g,
            ),
            condition(
                "RolledBack",
                false,
                "NameConflict",
                "no generation of this object serves",
                g,
            ),
        ),
    };
    let mut status = json!({ "conditions": [accepted, ready, rolled_back] });
    if let Some(g) = g {
        status["observedGeneration"] = json!(g);
    }
    if let Some(s) = e.serving_generation {
        status["activeGeneration"] = json!(s);
    }
    status
}

/// Whether `live` already says what `desired` says (ignoring transition times).
pub fn same_status(live: Option<&Value>, desired: &Value) -> bool {
    let Some(live) = live else {
        return false;
    };
    let key = |v: &Value| {
        let mut conditions: Vec<(String, String, String, String, Option<i64>)> = v
            .get("conditions")
            .and_then(|c| c.as_array())
            .map(|cs| {
                cs.iter()
                    .map(|c| {
                        let s = |k: &str| {
                            c.get(k)
                                .and_then(|x| x.as_str())
                                .unwrap_or_default()
                                .to_string()
                        };
                        (
                            s("type"),
                            s("status"),
                            s("reason"),
                            s("message"),
                            c.get("observedGeneration").and_then(|x| x.as_i64()),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        conditions.sort();
        (
            v.get("observedGeneration").and_then(|x| x.as_i64()),
            v.get("activeGeneration").and_then(|x| x.as_i64()),
            conditions,
        )
    };
    key(live) == key(desired)
}

/// Patches the status of `e` (server-side apply, field manager [`FIELD_MANAGER`]).
pub async fn write(client: &Client, e: &ObjectEntry) -> Result<(), kube::Error> {
    let Some(ar) = api_resource(e.object.kind) else {
        return Ok(());
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &e.object.namespace, &ar);
    let patch = json!({
        "apiVersion": kinference_crds::API_VERSION,
        "kind": e.object.kind,
        "metadata": { "name": e.object.name },
        "status": desired_status(e),
    });
    api.patch_status(
        &e.object.name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

/// Writes the status of every object whose live status differs, while `leader` is true.
/// Returns when the snapshot channel closes.
pub async fn run(
    client: Client,
    mut snapshots: watch::Receiver<Arc<Snapshot>>,
    mut leader: watch::Receiver<bool>,
    writes: Arc<std::sync::atomic::AtomicU64>,
) {
    // What this writer wrote last (object, uid) -> status: the watch may lag behind a write.
    let mut written: std::collections::BTreeMap<(super::ObjectRef, Option<String>), Value> =
        Default::default();
    loop {
        let is_leader = *leader.borrow_and_update();
        if is_leader {
            let snapshot = Arc::clone(&snapshots.borrow_and_update());
            if snapshot.synced {
                written.retain(|(o, _), _| snapshot.objects.contains_key(o));
                for e in snapshot.objects.values() {
                    let desired = desired_status(e);
                    if same_status(e.live_status.as_ref(), &desired) {
                        continue;
                    }
                    let k = (e.object.clone(), e.uid.clone());
                    if written
                        .get(&k)
                        .is_some_and(|w| same_status(Some(w), &desired))
                    {
                        continue;
                    }
                    match write(&client, e).await {
                        Ok(()) => {
                            writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            written.insert(k, desired);
                        }
                        Err(error) => {
                            tracing::warn!(object = %e.object, %error, "status not written");
                        }
                    }
                }
            }
        } else {
            written.clear();
        }
        tokio::select! {
            r = snapshots.changed() => if r.is_err() { return },
            r = leader.changed() => if r.is_err() { return },
            // Retry failed writes and catch up after the watch saw someone else's status.
            _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => written.clear(),
        }
    }
}
