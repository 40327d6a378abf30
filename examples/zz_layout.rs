use tidepool::trace::replay::{replay, Policy, ReplayOptions};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let trace = tidepool::trace::load(std::path::Path::new(&a[1])).unwrap();
    let cap: u64 = a[2].parse::<u64>().unwrap() << 20;
    let conf = a.get(4).cloned().unwrap_or_default();
    let o = ReplayOptions { capacity: cap, policy: Policy::Expandable, conf, samples: 0, record_to: Some(a[3].clone().into()) };
    let r = replay(&trace, &o).unwrap();
    println!("ooms {} peak_reserved {}", r.ooms, r.peak_reserved_bytes >> 20);
}
