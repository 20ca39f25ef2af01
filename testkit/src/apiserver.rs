//! A real etcd + kube-apiserver (v1.20) on loopback, from the project's scripts in
//! `deploy/tests/kube-apiserver/` (`build.sh` builds it once into `~/.cache/kube-test`, `start.sh` starts
//! it in a fresh folder, `stop.sh` stops it).
//!
//! Runs only with `KINFERENCE_TEST_APISERVER=1`: otherwise [`Apiserver::start`] skips (and fails under CI).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::paths::repo_root;
use crate::process::port_free;

/// The environment variable that turns the apiserver tests on.
pub const ENV_ENABLE: &str = "KINFERENCE_TEST_APISERVER";

/// The folder of `build.sh`, `start.sh` and `stop.sh`.
pub fn scripts() -> PathBuf {
    repo_root().join("deploy/tests/kube-apiserver")
}

/// etcd + kube-apiserver started by `start.sh`; stopped (and its folder removed) on drop.
#[derive(Debug)]
pub struct Apiserver {
    dir: PathBuf,
    kubeconfig: PathBuf,
}

impl Apiserver {
    /// Builds (once per process; `build.sh` is a no-op once built) and starts an apiserver in a folder
    /// named after `tag`. `None`, after [`crate::skip`], without `KINFERENCE_TEST_APISERVER=1`.
    #[track_caller]
    pub fn start(tag: &str) -> Option<Apiserver> {
        let enabled = std::env::var(ENV_ENABLE).as_deref() == Ok("1");
        if !crate::require(
            enabled,
            "kube-apiserver",
            format_args!(
                "set {ENV_ENABLE}=1 to run against a real kube-apiserver \
                 (deploy/tests/kube-apiserver/build.sh builds it once)"
            ),
        ) {
            return None;
        }
        build();
        let dir = std::env::temp_dir().join(format!("kinference-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new("bash")
            .arg(scripts().join("start.sh"))
            .arg(&dir)
            .arg(free_port_triple().to_string())
            .output()
            .expect("run start.sh");
        // The guard first, so a failed start still stops what did start.
        let server = Apiserver {
            kubeconfig: dir.join("kubeconfig"),
            dir,
        };
        assert!(
            out.status.success(),
            "start.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(server)
    }

    /// The admin kubeconfig `start.sh` wrote.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The folder holding the server's data, certificates and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Apiserver {
    fn drop(&mut self) {
        let pids: Vec<String> = ["apiserver.pid", "etcd.pid"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(self.dir.join(f)).ok())
            .map(|p| p.trim().to_string())
            .collect();
        let _ = Command::new("bash")
            .arg(scripts().join("stop.sh"))
            .arg(&self.dir)
            .status();
        // The apiserver shuts down gracefully for a few seconds: wait for it, then kill what this test
        // started (by pid) if it is still there.
        for pid in &pids {
            let stat = Path::new("/proc").join(pid).join("stat");
            // A zombie (state Z) has exited; only its parent can reap it.
            let alive = || {
                std::fs::read_to_string(&stat).is_ok_and(|st| {
                    st.rsplit(')')
                        .next()
                        .is_some_and(|r| !r.trim_start().starts_with('Z'))
                })
            };
            for _ in 0..100 {
                if !alive() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if alive() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `build.sh` once per test process (tests of one binary start servers in parallel).
fn build() {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let result = BUILT.get_or_init(|| {
        let out = Command::new("bash")
            .arg(scripts().join("build.sh"))
            .output()
            .map_err(|e| format!("run build.sh: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "build.sh failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A port P with P-4064 and P-4063 free too (`start.sh` puts etcd there). P is the kernel's pick:
/// ports handed out in turn by [`crate::free_port`] would put two apiservers started side by side
/// one port apart, and the first one's second etcd port on the other's first.
fn free_port_triple() -> u16 {
    loop {
        let p = crate::process::kernel_port();
        if p > 20000 && port_free(p - 4064) && port_free(p - 4063) {
            return p;
        }
    }
}
