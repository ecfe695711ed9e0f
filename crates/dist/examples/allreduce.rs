//! Three ranks (threads of this process, as three processes would be)
//! join a job on localhost and average their values: every rank prints the
//! same mean. `cargo run -p kiln-dist --example allreduce`.

#![allow(clippy::print_stdout, reason = "an example prints its result")]

use std::time::Duration;

use kiln_dist::{Group, Reduce, WorldSpec};

fn main() -> Result<(), kiln_dist::DistError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| kiln_dist::DistError::Io {
            what: "finding a free port".into(),
            source,
        })?;
    let world = 3;
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || -> Result<Vec<f32>, kiln_dist::DistError> {
                let spec = WorldSpec::local(rank, world, port);
                let group = Group::connect(&spec, Duration::from_secs(10))?;
                let mut values = vec![rank as f32, 10.0 * rank as f32];
                group.all_reduce(&mut values, Reduce::Mean)?;
                Ok(values)
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        match handle.join() {
            Ok(result) => println!("rank {rank}: {:?}", result?),
            Err(_) => println!("rank {rank} panicked"),
        }
    }
    Ok(())
}
