//! Under torchrun: finding rank 0 through torchrun's own store.
//!
//! torchrun's agent hosts PyTorch's TCPStore at `MASTER_PORT` and tells
//! its workers so (`TORCHELASTIC_USE_AGENT_STORE=True`): PyTorch's ranks
//! connect to it as clients. kiln's rank 0 cannot listen there, so it
//! listens at a free port and writes that port into the store; the other
//! ranks wait for the key and connect to `MASTER_ADDR` at that port. What
//! kiln needs of TCPStore is four queries of its wire format (c10d's: a
//! query byte; a string or bytes as a little-endian `u64` length and the
//! bytes): VALIDATE with c10d's magic number, SET, WAIT and GET.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::DistError;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const WAIT: u8 = 6;
/// c10d's `validationMagicNumber`.
const MAGIC: u32 = 0x3C85_F7CE;
/// WAIT's answer once every key it names is set.
const STOP_WAITING: u8 = 0;

/// The key rank 0's port goes under: one a torchrun run and restart, so
/// that a restarted job never reads the port of the attempt before it.
pub(crate) fn rendezvous_key(run_id: &str, restart: &str) -> String {
    format!("kiln/{run_id}/attempt_{restart}/rendezvous_port")
}

/// A connection to torchrun's store.
pub(crate) struct Store {
    stream: TcpStream,
    addr: String,
}

impl Store {
    /// Connects to the store at `host:port`, retrying until `timeout`
    /// (the agent starts it before its workers, but a slow DNS or a busy
    /// machine may delay the first answer).
    pub(crate) fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self, DistError> {
        let addr = format!("{host}:{port}");
        let stream = crate::group::connect_until(host, port, Instant::now() + timeout)?
            .ok_or_else(|| DistError::RendezvousTimeout {
                addr: format!("torchrun's store at {addr}"),
                missing: "the store (torchrun's agent)".into(),
                waited: timeout,
                remedy: crate::error::LAUNCHERS_AGREE,
            })?;
        let mut store = Self { stream, addr };
        let mut query = vec![VALIDATE];
        query.extend_from_slice(&MAGIC.to_le_bytes());
        store.send(&query)?;
        Ok(store)
    }

    /// Sets `key` to `value`.
    pub(crate) fn set(&mut self, key: &str, value: &[u8]) -> Result<(), DistError> {
        let mut query = vec![SET];
        put_bytes(&mut query, key.as_bytes());
        put_bytes(&mut query, value);
        self.send(&query)
    }

    /// `key`'s value, once some client has set it; `None` if none has
    /// within `timeout`.
    pub(crate) fn wait_get(
        &mut self,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<Vec<u8>>, DistError> {
        let mut query = vec![WAIT];
        query.extend_from_slice(&1u64.to_le_bytes());
        put_bytes(&mut query, key.as_bytes());
        self.send(&query)?;
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(|e| self.io(e))?;
        let mut answer = [0u8; 1];
        match self.stream.read_exact(&mut answer) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(self.io(e)),
        }
        if answer[0] != STOP_WAITING {
            return Err(self.unexpected(format!("WAIT answered {}", answer[0])));
        }
        let mut query = vec![GET];
        put_bytes(&mut query, key.as_bytes());
        self.send(&query)?;
        let mut len = [0u8; 8];
        self.stream.read_exact(&mut len).map_err(|e| self.io(e))?;
        let len = u64::from_le_bytes(len);
        if len > 1 << 20 {
            return Err(self.unexpected(format!("GET answered a value of {len} bytes")));
        }
        let mut value = vec![0u8; len as usize];
        self.stream.read_exact(&mut value).map_err(|e| self.io(e))?;
        Ok(Some(value))
    }

    fn send(&mut self, query: &[u8]) -> Result<(), DistError> {
        self.stream.write_all(query).map_err(|e| self.io(e))
    }

    fn io(&self, source: std::io::Error) -> DistError {
        DistError::Io {
            what: format!(
                "talking to torchrun's store at {} ({})",
                self.addr,
                crate::error::STORE_PROTOCOL
            ),
            source,
        }
    }

    fn unexpected(&self, what: String) -> DistError {
        DistError::BadLaunch {
            what: format!("torchrun's store at {}", self.addr),
            why: format!(
                "{what}, not TCPStore's answer; {}",
                crate::error::STORE_PROTOCOL
            ),
        }
    }
}

/// A string or bytes as c10d writes them: its length, then itself.
fn put_bytes(query: &mut Vec<u8>, bytes: &[u8]) {
    query.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    query.extend_from_slice(bytes);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::net::TcpListener;
    use std::sync::{Arc, Condvar, Mutex};

    /// The stand-in store's keys, and the waits on them.
    type Keys = (Mutex<HashMap<Vec<u8>, Vec<u8>>>, Condvar);

    /// A stand-in for torchrun's TCPStore: c10d's wire format for the
    /// queries kiln sends (VALIDATE first, then SET, WAIT, GET), a thread
    /// a client, WAIT answered once its keys are set. Returns its port.
    pub(crate) fn fake_store() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
        let port = listener.local_addr().expect("addr").port();
        let keys = Arc::new((
            Mutex::new(HashMap::<Vec<u8>, Vec<u8>>::new()),
            Condvar::new(),
        ));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let keys = keys.clone();
                std::thread::spawn(move || serve(stream, &keys));
            }
        });
        port
    }

    fn serve(mut s: TcpStream, keys: &Keys) {
        let u64_of = |s: &mut TcpStream| -> Option<u64> {
            let mut b = [0u8; 8];
            s.read_exact(&mut b).ok()?;
            Some(u64::from_le_bytes(b))
        };
        let bytes_of = |s: &mut TcpStream| -> Option<Vec<u8>> {
            let n = u64_of(s)?;
            let mut b = vec![0u8; n as usize];
            s.read_exact(&mut b).ok()?;
            Some(b)
        };
        let mut query = [0u8; 1];
        let mut validated = false;
        while s.read_exact(&mut query).is_ok() {
            match query[0] {
                VALIDATE => {
                    let mut m = [0u8; 4];
                    if s.read_exact(&mut m).is_err() || u32::from_le_bytes(m) != MAGIC {
                        return;
                    }
                    validated = true;
                }
                // c10d's server drops a client that did not validate.
                _ if !validated => return,
                SET => {
                    let (Some(k), Some(v)) = (bytes_of(&mut s), bytes_of(&mut s)) else {
                        return;
                    };
                    keys.0.lock().expect("keys").insert(k, v);
                    keys.1.notify_all();
                }
                WAIT => {
                    let Some(n) = u64_of(&mut s) else { return };
                    let Some(wanted) = (0..n).map(|_| bytes_of(&mut s)).collect::<Option<Vec<_>>>()
                    else {
                        return;
                    };
                    let mut held = keys.0.lock().expect("keys");
                    while !wanted.iter().all(|k| held.contains_key(k)) {
                        held = keys.1.wait(held).expect("keys");
                    }
                    drop(held);
                    if s.write_all(&[STOP_WAITING]).is_err() {
                        return;
                    }
                }
                GET => {
                    let Some(k) = bytes_of(&mut s) else { return };
                    let v = keys
                        .0
                        .lock()
                        .expect("keys")
                        .get(&k)
                        .cloned()
                        .unwrap_or_default();
                    let mut answer = (v.len() as u64).to_le_bytes().to_vec();
                    answer.extend_from_slice(&v);
                    if s.write_all(&answer).is_err() {
                        return;
                    }
                }
                _ => return,
            }
        }
    }

    #[test]
    fn a_key_set_by_one_client_is_waited_for_and_read_by_another() {
        let port = fake_store();
        let t = Duration::from_secs(10);
        let reader = std::thread::spawn(move || {
            let mut store = Store::connect("127.0.0.1", port, t).expect("connects");
            store.wait_get("kiln/x/attempt_0/rendezvous_port", t)
        });
        std::thread::sleep(Duration::from_millis(50));
        let mut store = Store::connect("127.0.0.1", port, t).expect("connects");
        store
            .set("kiln/x/attempt_0/rendezvous_port", b"41234")
            .expect("sets");
        let got = reader.join().expect("reader").expect("reads");
        assert_eq!(got.as_deref(), Some(&b"41234"[..]));
        // A key no one sets: nothing within the timeout, not an error.
        let none = store
            .wait_get(
                "kiln/x/attempt_1/rendezvous_port",
                Duration::from_millis(100),
            )
            .expect("waits");
        assert_eq!(none, None);
    }

    #[test]
    fn each_restart_has_its_own_key() {
        assert_ne!(rendezvous_key("r", "0"), rendezvous_key("r", "1"));
        assert_ne!(rendezvous_key("a", "0"), rendezvous_key("b", "0"));
    }
}
