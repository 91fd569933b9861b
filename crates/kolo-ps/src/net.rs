//! Authenticated request/response connections (the job token's challenge-response, then frames).
//! Generic over the message types ([`Protocol`]): the parameter servers speak [`Ps`]; other
//! services (federated averaging) bring their own messages and handshake purpose.

use crate::wire::{Req, Resp};
use crate::PsError;
use kolo_rendezvous::auth::{client_handshake, server_handshake};
use kolo_rendezvous::handshakes::{Handshakes, WholeDeadline};
use kolo_rendezvous::wire::{read_frame, write_frame};
use kolo_rendezvous::JobToken;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const PURPOSE: &str = "ps";
const HANDSHAKE: Duration = Duration::from_secs(10);
/// Connections in their handshake before a new one evicts the oldest (see
/// `kolo_rendezvous::handshakes`).
const MAX_UNAUTHENTICATED: usize = 64;

/// Open connections by id (a clone each, so [`Listener::kill`] can cut them); a connection
/// removes itself when it ends (issue #19: finished and refused ones were kept forever, and a
/// server went from 15 to 2018 open files after 2000 connections).
type Conns = Arc<Mutex<std::collections::HashMap<u64, TcpStream>>>;

/// A request/response message set: what travels, how it is encoded, and the purpose string
/// the handshake binds the connection to.
pub trait Protocol: 'static {
    const PURPOSE: &'static str;
    type Req: Send;
    type Resp;
    fn encode_req(r: &Self::Req) -> Vec<u8>;
    fn decode_req(b: &[u8]) -> Result<Self::Req, PsError>;
    fn encode_resp(r: &Self::Resp) -> Vec<u8>;
    fn decode_resp(b: &[u8]) -> Result<Self::Resp, PsError>;
    /// The answer to a request that did not decode.
    fn error_resp(msg: String) -> Self::Resp;
}

/// Declares a [`Protocol`] for request and answer types that have `encode(&self) -> Vec<u8>`,
/// `decode(&[u8]) -> Result<Self, PsError>` and an `Error(String)` answer.
#[macro_export]
macro_rules! protocol {
    ($(#[$m:meta])* $name:ident, $purpose:expr, $req:ty, $resp:ty, $error:path) => {
        $(#[$m])*
        pub struct $name;

        impl $crate::net::Protocol for $name {
            const PURPOSE: &'static str = $purpose;
            type Req = $req;
            type Resp = $resp;
            fn encode_req(r: &$req) -> Vec<u8> {
                r.encode()
            }
            fn decode_req(b: &[u8]) -> Result<$req, $crate::PsError> {
                <$req>::decode(b)
            }
            fn encode_resp(r: &$resp) -> Vec<u8> {
                r.encode()
            }
            fn decode_resp(b: &[u8]) -> Result<$resp, $crate::PsError> {
                <$resp>::decode(b)
            }
            fn error_resp(msg: String) -> $resp {
                $error(msg)
            }
        }
    };
}

protocol!(
    /// The parameter servers' protocol.
    Ps, PURPOSE, Req, Resp, Resp::Error
);

/// A client connection speaking protocol `P`; every byte in and out is counted.
pub struct Channel<P: Protocol> {
    stream: TcpStream,
    pub peer: String,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// When recording: every frame body sent (tests check what left a client).
    pub sent: Option<Vec<u8>>,
    _p: std::marker::PhantomData<P>,
}

/// A parameter-server connection.
pub type Conn = Channel<Ps>;

impl<P: Protocol> Channel<P> {
    /// Connects (retrying refused connections until `timeout`) and proves the job token.
    pub fn connect(addr: &str, token: &JobToken, timeout: Duration) -> Result<Self, PsError> {
        Self::open(addr, token, timeout, true)
    }

    /// Connects once: a refused connection is an error at once (a peer that is down).
    pub fn connect_once(addr: &str, token: &JobToken, timeout: Duration) -> Result<Self, PsError> {
        Self::open(addr, token, timeout, false)
    }

    fn open(addr: &str, token: &JobToken, timeout: Duration, patient: bool) -> Result<Self, PsError> {
        let deadline = Instant::now() + if patient { timeout } else { Duration::ZERO };
        loop {
            match Self::open_one(addr, token, timeout, deadline) {
                // Turned away before the challenge: the listener is at its limit of
                // connections in authentication (a flood); a patient client tries again.
                Err(PsError::Io(m)) if patient && Instant::now() < deadline && m.contains(kolo_rendezvous::auth::NO_CHALLENGE) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                r => return r,
            }
        }
    }

    fn open_one(addr: &str, token: &JobToken, timeout: Duration, deadline: Instant) -> Result<Self, PsError> {
        let stream = loop {
            let target = addr
                .to_socket_addrs()
                .map_err(|e| PsError::Io(format!("{addr}: {e}")))?
                .next()
                .ok_or_else(|| PsError::Io(format!("{addr}: no address")))?;
            match TcpStream::connect_timeout(&target, Duration::from_secs(2).min(timeout)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline && matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => return Err(PsError::Io(format!("connecting to {addr}: {e}"))),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut stream = stream;
        stream.set_read_timeout(Some(HANDSHAKE)).map_err(io_err(addr))?;
        stream.set_write_timeout(Some(HANDSHAKE)).map_err(io_err(addr))?;
        client_handshake(&mut stream, token, P::PURPOSE, addr)?;
        let t = Some(timeout.max(Duration::from_millis(10)));
        stream.set_read_timeout(t).map_err(io_err(addr))?;
        stream.set_write_timeout(t).map_err(io_err(addr))?;
        Ok(Channel { stream, peer: addr.to_string(), bytes_out: 0, bytes_in: 0, sent: None, _p: std::marker::PhantomData })
    }

    pub fn send(&mut self, req: &P::Req) -> Result<(), PsError> {
        let body = P::encode_req(req);
        self.bytes_out += body.len() as u64 + 4;
        if let Some(rec) = self.sent.as_mut() {
            rec.extend_from_slice(&body);
        }
        write_frame(&mut self.stream, &body).map_err(|e| PsError::Io(format!("sending to {}: {e}", self.peer)))
    }

    pub fn recv(&mut self) -> Result<P::Resp, PsError> {
        let body = read_frame(&mut self.stream)
            .map_err(|e| PsError::Io(format!("waiting for {}: {e}", self.peer)))?
            .ok_or_else(|| PsError::Io(format!("{} closed the connection", self.peer)))?;
        self.bytes_in += body.len() as u64 + 4;
        P::decode_resp(&body)
    }

    pub fn call(&mut self, req: &P::Req) -> Result<P::Resp, PsError> {
        self.send(req)?;
        self.recv()
    }
}

fn io_err(addr: &str) -> impl Fn(io::Error) -> PsError + '_ {
    move |e| PsError::Io(format!("{addr}: {e}"))
}

/// A listener whose connections each get a thread running `handle` for every request after the
/// handshake. Dropping (or [`Listener::kill`]) closes the listener and every connection at once,
/// which is what a crash looks like to the peers.
pub struct Listener {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Conns,
    acceptor: Option<JoinHandle<()>>,
}

/// Per connection: answers one request. `bytes` is the request's size.
pub type Handler = HandlerOf<Ps>;
/// A handler for protocol `P`.
pub type HandlerOf<P> = Arc<dyn Fn(&mut ConnState, <P as Protocol>::Req, usize) -> <P as Protocol>::Resp + Send + Sync>;

/// What a connection remembers between requests (key caching).
#[derive(Default)]
pub struct ConnState {
    pub key_lists: std::collections::HashMap<u64, Arc<Vec<u32>>>,
    /// The client id this connection joined as (the federated server binds one per connection).
    pub client: Option<u32>,
}

impl Listener {
    pub fn start(addr: impl ToSocketAddrs, token: JobToken, name: &str, handle: Handler) -> io::Result<Listener> {
        Listener::start_with::<Ps>(addr, token, name, handle)
    }

    /// A listener for protocol `P`.
    pub fn start_with<P: Protocol>(addr: impl ToSocketAddrs, token: JobToken, name: &str, handle: HandlerOf<P>) -> io::Result<Listener> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::new(Mutex::new(std::collections::HashMap::new()));
        let acceptor = {
            let (stop, conns, name) = (stop.clone(), conns.clone(), name.to_string());
            let handshakes = Arc::new(Handshakes::new(MAX_UNAUTHENTICATED));
            let refused = Arc::new(AtomicU64::new(0));
            let (mut next_id, mut turned_away) = (0u64, 0u64);
            std::thread::Builder::new().name(format!("kolo-{name}")).spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((stream, peer)) => {
                            let id = next_id;
                            next_id += 1;
                            if !handshakes.admit(id, &stream) {
                                turned_away += 1;
                                if turned_away.is_power_of_two() {
                                    let at_once = 2 * MAX_UNAUTHENTICATED;
                                    kolo_base::eline!("kolo {name}: {at_once} connections are authenticating; turned away {turned_away} so far (latest {peer})");
                                }
                                continue; // closed by the drop
                            }
                            if let Ok(c) = stream.try_clone() {
                                conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, c);
                            }
                            let (token, handle, stop, name) = (token.clone(), handle.clone(), stop.clone(), name.clone());
                            let (mine, hs, refused) = (conns.clone(), handshakes.clone(), refused.clone());
                            let spawned = std::thread::Builder::new().name(format!("kolo-{name}-conn")).spawn(move || {
                                serve::<P>(stream, peer, &token, &*handle, &stop, &name, &|| hs.done(id), &refused);
                                mine.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                            });
                            if spawned.is_err() {
                                handshakes.done(id);
                                conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
                        Err(e) => {
                            tracing::warn!("kolo {name}: accept failed: {e}");
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
            })?
        };
        Ok(Listener { addr, stop, conns, acceptor: Some(acceptor) })
    }

    /// Stops accepting and cuts every connection.
    pub fn kill(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for (_, c) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.kill();
    }
}

#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn serve<P: Protocol>(
    mut stream: TcpStream,
    peer: SocketAddr,
    token: &JobToken,
    handle: &(dyn Fn(&mut ConnState, P::Req, usize) -> P::Resp + Send + Sync),
    stop: &AtomicBool,
    name: &str,
    handshake_over: &dyn Fn(),
    refused: &AtomicU64,
) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(HANDSHAKE));
    // One deadline for the whole handshake, however slowly it trickles in.
    let hs = server_handshake(&mut WholeDeadline::new(&mut stream, HANDSHAKE), token, Some(P::PURPOSE), &peer.to_string());
    handshake_over();
    if let Err(e) = hs {
        // Under a flood, reported at powers of two rather than once per connection.
        let n = refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            kolo_base::eline!("kolo {name}: refused connection from {peer}: {e} ({n} refused so far)");
        }
        return;
    }
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(300)));
    let mut state = ConnState::default();
    while !stop.load(Ordering::SeqCst) {
        let body = match read_frame(&mut stream) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!("kolo {name}: dropping {peer}: {e}");
                return;
            }
        };
        let resp = match P::decode_req(&body) {
            Ok(req) => handle(&mut state, req, body.len()),
            Err(e) => {
                // The framing cannot be trusted after a malformed request: answer and hang up.
                let _ = write_frame(&mut stream, &P::encode_resp(&P::error_resp(format!("malformed request from {peer}: {e}"))));
                kolo_base::eline!("kolo {name}: malformed request from {peer}: {e}");
                return;
            }
        };
        if stop.load(Ordering::SeqCst) || write_frame(&mut stream, &P::encode_resp(&resp)).is_err() {
            return;
        }
    }
}
