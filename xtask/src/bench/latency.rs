//! `--db-latency-us`: a forwarder of the bench's own between every contender and the database
//! server, delaying each chunk of bytes by the same time each way, in order, as a network
//! between an application and its database would (the machine's loopback answers in tens of
//! microseconds, where a database in the same zone answers in hundreds). Threads and blocking
//! sockets, not tokio, whose timer counts whole milliseconds.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The forwarders started, by upstream `host:port`: their port.
static FORWARDERS: OnceLock<Mutex<HashMap<String, u16>>> = OnceLock::new();

/// `url` (a PostgreSQL or MySQL URL, `scheme://user@host:port/db`) through a forwarder that
/// delays every chunk by `delay` each way, started the first time its server is asked for;
/// `url` itself when `delay` is zero.
pub fn through(url: &str, delay: Duration) -> Result<String, String> {
    if delay.is_zero() {
        return Ok(url.to_owned());
    }
    let (head, rest) = url
        .split_once('@')
        .ok_or_else(|| format!("--db-latency-us: no host in {url:?}"))?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let upstream = &rest[..end];
    let mut forwarders = FORWARDERS
        .get_or_init(Mutex::default)
        .lock()
        .map_err(|_| "the forwarders' lock".to_owned())?;
    let port = match forwarders.get(upstream) {
        Some(&port) => port,
        None => {
            let port = start(upstream.to_owned(), delay)?;
            forwarders.insert(upstream.to_owned(), port);
            port
        }
    };
    Ok(format!("{head}@127.0.0.1:{port}{}", &rest[end..]))
}

/// Listens on a free loopback port, forwarding every connection to `upstream`.
fn start(upstream: String, delay: Duration) -> Result<u16, String> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind a forwarder: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    std::thread::spawn(move || {
        for inbound in listener.incoming().flatten() {
            let Ok(outbound) = TcpStream::connect(&upstream) else {
                continue;
            };
            for (from, to) in [(&inbound, &outbound), (&outbound, &inbound)] {
                let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) else {
                    continue;
                };
                let _ = from.set_nodelay(true);
                std::thread::spawn(move || pipe(from, to, delay));
            }
        }
    });
    Ok(port)
}

/// Reads `from` and writes what it read to `to`, each chunk `delay` after it was read.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (chunks, due) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = std::thread::spawn(move || {
        for (at, bytes) in due {
            if let Some(wait) = at.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    let mut buf = vec![0; 64 * 1024];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0
            || chunks
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
        {
            break;
        }
    }
    drop(chunks);
    let _ = writer.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_goes_through_a_forwarder_of_its_server() {
        let url = "mysql://root@127.0.0.1:3306/inbox_bench_x";
        assert_eq!(through(url, Duration::ZERO).unwrap(), url);
        let delayed = through(url, Duration::from_micros(100)).unwrap();
        let again = through(
            "mysql://root@127.0.0.1:3306/other?x=1",
            Duration::from_micros(100),
        );
        let port = delayed
            .strip_prefix("mysql://root@127.0.0.1:")
            .and_then(|p| p.strip_suffix("/inbox_bench_x"))
            .expect("the forwarder's URL");
        assert_ne!(port, "3306");
        assert_eq!(
            again.unwrap(),
            format!("mysql://root@127.0.0.1:{port}/other?x=1")
        );
    }

    #[test]
    fn bytes_arrive_in_order_and_late() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = server.local_addr().unwrap().to_string();
        let echo = std::thread::spawn(move || {
            let (mut s, _) = server.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            s.write_all(&got).unwrap();
        });
        let delay = Duration::from_millis(20);
        let port = start(upstream, delay).unwrap();
        let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let sent = Instant::now();
        for chunk in [&b"one "[..], b"two ", b"three"] {
            client.write_all(chunk).unwrap();
        }
        client.shutdown(Shutdown::Write).unwrap();
        let mut back = Vec::new();
        client.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"one two three");
        assert!(sent.elapsed() >= 2 * delay, "{:?}", sent.elapsed());
        echo.join().unwrap();
    }
}
