mod e2e_support;
use e2e_support::*;
#[test]
fn scratch() {
    let fleet = Fleet::start();
    let base = fleet.base_url();
    for i in 0..6 {
        let c = Chat::new(RR_MODEL, &format!("s{i}"), &[("user".to_string(), "What is the capital of France?".to_string())], 8, false);
        let r = fleet.block_on(send(&fleet.http, &base, &c));
        println!("{i} {:?} cached {} {:?}", r.worker, r.cached_tokens(), r.text);
    }
}
