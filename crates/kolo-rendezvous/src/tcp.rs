//! The TCP store: a server thread hosted by rank 0 and a client per rank.

use crate::auth::{client_handshake, server_handshake, JobToken};
use crate::handshakes::{Handshakes, WholeDeadline};
use crate::memory::add_to;
use crate::wire::{read_frame, write_frame, Request, Response};
use crate::{Store, StoreError};
use kolo_base::Deadline;
use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const PURPOSE: &str = "store";
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections that may be in their handshake at once. A connection beyond them evicts the
/// oldest one still in its handshake (a slow or idle client: a rank's handshake takes
/// milliseconds), and handshakes are capped at twice this, so a flood of unauthenticated or
/// trickling connections exhausts neither threads nor descriptors nor the ranks' way in.
const MAX_UNAUTHENTICATED: usize = 64;
/// Longest a single server-side `get` may block; clients loop for longer deadlines.
const MAX_SERVER_WAIT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct State {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Refused connections so far (logged at powers of two).
    refused: AtomicU64,
}

/// Open connections by id: a clone of each, so that dropping the server can shut them all; a
/// connection removes itself when it ends (issue #19: finished and refused ones were kept
/// forever, and a flood exhausted the descriptors).
type Conns = Arc<Mutex<HashMap<u64, TcpStream>>>;

/// The store's server. Dropping it stops accepting and closes every client connection.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Conns,
    acceptor: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving.
    pub fn start(addr: impl ToSocketAddrs, token: JobToken) -> io::Result<TcpStoreServer> {
        Self::start_on(TcpListener::bind(addr)?, token)
    }

    /// Serves on a socket already bound and listening (one a launcher handed over).
    pub fn start_on(listener: TcpListener, token: JobToken) -> io::Result<TcpStoreServer> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::new(Mutex::new(HashMap::new()));
        let state = Arc::new(State::default());
        let acceptor = {
            let (stop, conns) = (stop.clone(), conns.clone());
            std::thread::Builder::new().name("kolo-store".into()).spawn(move || accept_loop(listener, token, state, stop, conns))?
        };
        Ok(TcpStoreServer { addr, stop, conns, acceptor: Some(acceptor) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap_or_else(|p| p.into_inner()).values() {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, token: JobToken, state: Arc<State>, stop: Arc<AtomicBool>, conns: Conns) {
    let handshakes = Arc::new(Handshakes::new(MAX_UNAUTHENTICATED));
    let (next_id, turned_away) = (AtomicU64::new(0), AtomicU64::new(0));
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let id = next_id.fetch_add(1, Ordering::Relaxed);
                if !handshakes.admit(id, &stream) {
                    // Closed at once (dropped); reported at powers of two, not per connection.
                    let n = turned_away.fetch_add(1, Ordering::Relaxed) + 1;
                    if n.is_power_of_two() {
                        kolo_base::eline!(
                            "kolo store: {} connections are authenticating; turned away {n} so far (latest {peer})",
                            2 * MAX_UNAUTHENTICATED
                        );
                    }
                    continue;
                }
                if let Ok(c) = stream.try_clone() {
                    conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, c);
                }
                let (token, state, stop, mine, hs) = (token.clone(), state.clone(), stop.clone(), conns.clone(), handshakes.clone());
                let spawned = std::thread::Builder::new().name("kolo-store-conn".into()).spawn(move || {
                    serve(stream, peer, &token, &state, &stop, &|| hs.done(id));
                    mine.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                });
                if spawned.is_err() {
                    handshakes.done(id);
                    conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                tracing::warn!("kolo store: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Serves one connection: its handshake (under one deadline; `handshake_over` when it ends,
/// either way), then requests until it closes.
fn serve(mut stream: TcpStream, peer: SocketAddr, token: &JobToken, state: &State, stop: &AtomicBool, handshake_over: &dyn Fn()) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
    let hs = server_handshake(&mut WholeDeadline::new(&mut stream, HANDSHAKE_TIMEOUT), token, Some(PURPOSE), &peer.to_string());
    handshake_over();
    if let Err(e) = hs {
        // Logged once (it was printed twice), and under a flood only at powers of two.
        let n = state.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!("kolo store: refused connection from {peer}: {e} ({n} refused so far)");
        }
        // A Kolo process of another job (a well-formed hello, a wrong token) fails the join
        // on every rank at once instead of leaving them to their deadline. Junk that is not a
        // Kolo hello is only logged: a flood of it cannot abort a job.
        if matches!(&e, StoreError::Auth { reason, .. } if reason == "wrong job token") {
            let why = format!("a process at {peer} tried to join with a different job token (check KOLO_JOB_TOKEN / --token-file)");
            let mut map = state.map.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(crate::join_error_key()).or_insert_with(|| why.into_bytes());
            state.changed.notify_all();
        }
        return;
    }
    let _ = stream.set_read_timeout(None);
    while !stop.load(Ordering::SeqCst) {
        let body = match read_frame(&mut stream) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("kolo store: dropping client {peer}: {e}");
                return;
            }
        };
        let resp = match Request::decode(&body) {
            Ok(req) => handle(state, req),
            Err(e) => {
                // A malformed request ends the connection: we cannot trust its framing after it.
                let _ = write_frame(&mut stream, &Response::Error(e.to_string()).encode());
                tracing::warn!("kolo store: malformed request from {peer}: {e}");
                return;
            }
        };
        if write_frame(&mut stream, &resp.encode()).is_err() {
            return;
        }
    }
}

fn handle(state: &State, req: Request) -> Response {
    let mut map = state.map.lock().unwrap_or_else(|p| p.into_inner());
    match req {
        Request::Set { key, value } => {
            map.insert(key, value);
            state.changed.notify_all();
            Response::Ok
        }
        Request::Get { key, timeout_ms } => {
            let deadline = Deadline::after(Duration::from_millis(timeout_ms).min(MAX_SERVER_WAIT));
            loop {
                if let Some(v) = map.get(&key) {
                    return Response::Value(v.clone());
                }
                let left = deadline.remaining();
                if left.is_zero() {
                    return Response::Timeout;
                }
                map = state.changed.wait_timeout(map, left).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
        Request::Add { key, delta } => {
            let r = add_to(&mut map, &key, delta);
            state.changed.notify_all();
            match r {
                Ok(v) => Response::Int(v),
                Err(e) => Response::Error(e.to_string()),
            }
        }
        Request::Check { key } => Response::Bool(map.contains_key(&key)),
        Request::Delete { key } => Response::Bool(map.remove(&key).is_some()),
    }
}

/// A client of [`TcpStoreServer`]. One request at a time per client (a mutex serialises them).
pub struct TcpStore {
    addr: String,
    token: JobToken,
    stream: Mutex<TcpStream>,
}

impl TcpStore {
    /// Connects, retrying until `deadline` while the server is not up yet, and authenticates.
    pub fn connect(addr: &str, token: &JobToken, deadline: Deadline) -> Result<TcpStore, StoreError> {
        let (start, mut said) = (std::time::Instant::now(), false);
        loop {
            let last = match Self::try_connect(addr, token) {
                Ok(stream) => return Ok(TcpStore { addr: addr.to_string(), token: token.clone(), stream: Mutex::new(stream) }),
                // Turned away before the handshake began (the server is at its limit of
                // connections in authentication, under a flood): try again.
                Err(StoreError::Auth { reason, .. }) if reason.starts_with(crate::auth::NO_CHALLENGE) => reason,
                // A wrong token will not get better by retrying.
                Err(e @ StoreError::Auth { .. }) => return Err(e),
                Err(e) => e.to_string(),
            };
            if deadline.expired() {
                return Err(StoreError::Connect {
                    addr: addr.to_string(),
                    reason: format!("gave up after {:?}: {last}", deadline.budget()),
                });
            }
            if !said && start.elapsed() > Duration::from_secs(5) {
                said = true;
                kolo_base::eline!(
                    "kolo: still waiting to join the store at {addr} after 5 s ({last}); retrying for {:?} more",
                    deadline.remaining()
                );
            }
            std::thread::sleep(Duration::from_millis(20).min(deadline.remaining()));
        }
    }

    fn try_connect(addr: &str, token: &JobToken) -> Result<TcpStream, StoreError> {
        let sa = addr
            .to_socket_addrs()
            .map_err(|e| StoreError::Connect { addr: addr.into(), reason: e.to_string() })?
            .next()
            .ok_or_else(|| StoreError::Connect { addr: addr.into(), reason: "no address".into() })?;
        let mut s = TcpStream::connect_timeout(&sa, HANDSHAKE_TIMEOUT)
            .map_err(|e| StoreError::Connect { addr: addr.into(), reason: e.to_string() })?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        s.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        client_handshake(&mut s, token, PURPOSE, addr)?;
        Ok(s)
    }

    fn call(&self, req: &Request, wait: Duration) -> Result<Response, StoreError> {
        let mut s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        s.set_read_timeout(Some(wait + HANDSHAKE_TIMEOUT))?;
        write_frame(&mut *s, &req.encode())?;
        let body = read_frame(&mut *s)
            .map_err(|e| StoreError::Io(format!("store at {}: {e}", self.addr)))?
            .ok_or_else(|| StoreError::Io(format!("store at {} closed the connection", self.addr)))?;
        match Response::decode(&body)? {
            Response::Error(m) => Err(StoreError::Server(m)),
            r => Ok(r),
        }
    }

    fn unexpected(r: Response) -> StoreError {
        StoreError::Protocol(format!("unexpected response {r:?}"))
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match self.call(&Request::Set { key: key.into(), value: value.to_vec() }, Duration::ZERO)? {
            Response::Ok => Ok(()),
            r => Err(Self::unexpected(r)),
        }
    }

    fn get(&self, key: &str, deadline: Deadline) -> Result<Vec<u8>, StoreError> {
        loop {
            let wait = deadline.remaining().min(MAX_SERVER_WAIT);
            let req = Request::Get { key: key.into(), timeout_ms: wait.as_millis() as u64 };
            match self.call(&req, wait)? {
                Response::Value(v) => return Ok(v),
                Response::Timeout if deadline.expired() => return Err(StoreError::Timeout { key: key.into(), waited: deadline.budget() }),
                Response::Timeout => {}
                r => return Err(Self::unexpected(r)),
            }
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match self.call(&Request::Add { key: key.into(), delta }, Duration::ZERO)? {
            Response::Int(v) => Ok(v),
            r => Err(Self::unexpected(r)),
        }
    }

    fn check(&self, key: &str) -> Result<bool, StoreError> {
        match self.call(&Request::Check { key: key.into() }, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            r => Err(Self::unexpected(r)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        match self.call(&Request::Delete { key: key.into() }, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            r => Err(Self::unexpected(r)),
        }
    }

    fn second_connection(&self) -> Option<Arc<dyn Store>> {
        let stream = Self::try_connect(&self.addr, &self.token).ok()?;
        Some(Arc::new(TcpStore { addr: self.addr.clone(), token: self.token.clone(), stream: Mutex::new(stream) }))
    }
}
