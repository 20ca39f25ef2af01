use super::*;

/// What settling one streamed request records for `tenant` (the counters, and the histograms when on).
fn one_request(m: &TenancyMetrics, tenant: &str) {
    let labels = TenantModel {
        tenant: tenant.into(),
        model: "m".into(),
    };
    m.requests
        .get_or_create(&TenantStatus {
            tenant: tenant.into(),
            model: "m".into(),
            status: 200,
        })
        .inc();
    for cache in ["cached", "uncached"] {
        m.input_tokens
            .get_or_create(&TenantCache {
                tenant: tenant.into(),
                model: "m".into(),
                cache,
            })
            .inc_by(10);
    }
    m.output_tokens.get_or_create(&labels).inc_by(5);
    m.cost
        .get_or_create(&TenantBackend {
            tenant: tenant.into(),
            model: "m".into(),
            pool: "p".into(),
            provider: String::new(),
        })
        .inc_by(0.25);
    m.spend
        .get_or_create(&TenantOnly {
            tenant: tenant.into(),
        })
        .set(0.25);
    m.observe_ttft(&labels, 0.02);
    m.observe_itl(&labels, 0.001);
    m.observe_e2e(&labels, 0.1);
    m.observe_sizes(&labels, 20, 5);
}

/// Series (sample lines) of the exposition that carry `tenant`.
fn series_of(text: &str, tenant: &str) -> usize {
    let label = format!("tenant=\"{tenant}\"");
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains(&label))
        .count()
}

fn exposition(histograms: bool) -> String {
    exposition_with(histograms, false)
}

fn exposition_with(histograms: bool, spend: bool) -> String {
    let mut registry = Registry::default();
    let m = TenancyMetrics::register(&mut registry, histograms, spend);
    for tenant in ["acme", "globex"] {
        one_request(&m, tenant);
    }
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}

#[test]
fn histograms_per_tenant_are_off_by_default_and_the_counters_stay() {
    let text = exposition(false);
    for histogram in [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "input_tokens_per_request",
        "output_tokens_per_request",
    ] {
        assert!(!text.contains(histogram), "{histogram} exported:\n{text}");
    }
    assert!(
        text.contains(
            "kinference_gateway_tenant_requests_total{tenant=\"acme\",model=\"m\",status=\"200\"} 1"
        ),
        "{text}"
    );
    assert!(text.contains(
        "kinference_gateway_tenant_output_tokens_total{tenant=\"globex\",model=\"m\"} 5"
    ));
    // requests, input tokens cached and uncached, output tokens.
    assert_eq!(series_of(&text, "acme"), 4, "{text}");
}

#[test]
fn histograms_per_tenant_when_turned_on() {
    let off = series_of(&exposition(false), "acme");
    let text = exposition(true);
    assert!(text.contains(
        "kinference_gateway_tenant_time_to_first_token_seconds_count{tenant=\"acme\",model=\"m\"} 1"
    ));
    assert!(text.contains(
        "kinference_gateway_tenant_input_tokens_per_request_sum{tenant=\"globex\",model=\"m\"} 20.0"
    ), "{text}");
    let on = series_of(&text, "acme");
    // Five histograms of 16 to 19 buckets (+Inf included) plus sum and count each.
    assert!(on >= off + 5 * 18, "{off} -> {on}");
    eprintln!("series per tenant and model: {off} without histograms, {on} with");
}

#[test]
fn spend_per_tenant_is_off_the_metrics_page_unless_asked() {
    // Who spends how much is the admin API's to tell (`/admin/usage`, behind the admin key), not an
    // open /metrics page's.
    let text = exposition(false);
    for family in [
        "kinference_gateway_tenant_cost",
        "kinference_gateway_tenant_budget_spent",
    ] {
        assert!(
            !text.contains(family),
            "{family} on the page by default:\n{text}"
        );
    }
    assert!(text.contains("kinference_gateway_tenant_output_tokens_total{"));
}

#[test]
fn spend_per_tenant_when_asked() {
    let text = exposition_with(false, true);
    assert!(text.contains(
        "kinference_gateway_tenant_cost_total{tenant=\"acme\",model=\"m\",pool=\"p\",provider=\"\"} 0.25"
    ), "{text}");
    assert!(text.contains("kinference_gateway_tenant_budget_spent{tenant=\"globex\"} 0.25"));
    assert_eq!(series_of(&text, "acme"), 6, "{text}");
}
