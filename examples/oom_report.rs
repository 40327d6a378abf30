//! Prints the out-of-memory report of a small simulated device.
//! `cargo run --example oom_report`
use tidepool::{Allocator, Config, Stream};

fn main() {
    let alloc = Allocator::new(Config::builder().host(1, 64 << 20).build().unwrap()).unwrap();
    let _weights = alloc.allocate(0, 30 << 20, Stream::DEFAULT).unwrap();
    let _small = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    match alloc.allocate(0, 40 << 20, Stream::DEFAULT) {
        Err(err) => println!("{err}"),
        Ok(_) => println!("no out-of-memory: the device is larger than expected"),
    }
}
