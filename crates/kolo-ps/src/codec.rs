//! Little-endian encoding with a total decoder: every read checks the bytes that remain, so a
//! malformed or hostile message is an error, never a panic or an unbounded allocation.

use crate::PsError;

#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f32s(&mut self, v: &[f32]) -> &mut Self {
        self.u64(v.len() as u64);
        self.0.reserve(v.len() * 4);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }
    pub fn u32s(&mut self, v: &[u32]) -> &mut Self {
        self.u64(v.len() as u64);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }
    pub fn u64s(&mut self, v: &[u64]) -> &mut Self {
        self.u64(v.len() as u64);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }
    /// A fixed-size byte array (no length prefix).
    pub fn array<const N: usize>(&mut self, v: &[u8; N]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, at: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], PsError> {
        if self.buf.len() - self.at < n {
            return Err(PsError::Protocol(format!(
                "message truncated: wanted {n} bytes at offset {}, {} left",
                self.at,
                self.buf.len() - self.at
            )));
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, PsError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, PsError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    pub fn u64(&mut self) -> Result<u64, PsError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub fn f32(&mut self) -> Result<f32, PsError> {
        Ok(f32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    pub fn f64(&mut self) -> Result<f64, PsError> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    /// A length prefix for items of `size` bytes, checked against what is left before any
    /// allocation.
    fn len(&mut self, size: usize) -> Result<usize, PsError> {
        let n = self.u64()?;
        let left = (self.buf.len() - self.at) / size;
        if n > left as u64 {
            return Err(PsError::Protocol(format!("a list announces {n} items but only {left} fit in the message")));
        }
        Ok(n as usize)
    }
    pub fn f32s(&mut self) -> Result<Vec<f32>, PsError> {
        let n = self.len(4)?;
        Ok(self.take(n * 4)?.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
    }
    pub fn u32s(&mut self) -> Result<Vec<u32>, PsError> {
        let n = self.len(4)?;
        Ok(self.take(n * 4)?.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
    }
    pub fn u64s(&mut self) -> Result<Vec<u64>, PsError> {
        let n = self.len(8)?;
        Ok(self.take(n * 8)?.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], PsError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    pub fn str(&mut self) -> Result<String, PsError> {
        let n = self.len(1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| PsError::Protocol("a string is not UTF-8".into()))
    }
    /// Every byte must have been consumed.
    pub fn end(&self) -> Result<(), PsError> {
        if self.at != self.buf.len() {
            return Err(PsError::Protocol(format!("{} trailing bytes after the message", self.buf.len() - self.at)));
        }
        Ok(())
    }
}
