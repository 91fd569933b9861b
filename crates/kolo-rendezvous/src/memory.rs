use crate::{Store, StoreError};
use kolo_base::Deadline;
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};

/// A store for ranks that are threads of one process (tests, the thread backend).
#[derive(Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panicking rank thread must not take the store down with it for everyone else.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Shared by the memory store and the TCP store's server.
pub(crate) fn add_to(map: &mut HashMap<String, Vec<u8>>, key: &str, delta: i64) -> Result<i64, StoreError> {
    let cur = match map.get(key) {
        None => 0,
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .ok_or_else(|| StoreError::NotAnInteger { key: key.to_string() })?,
    };
    let new = cur.wrapping_add(delta);
    map.insert(key.to_string(), new.to_string().into_bytes());
    Ok(new)
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, deadline: Deadline) -> Result<Vec<u8>, StoreError> {
        let mut map = self.lock();
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(StoreError::Timeout { key: key.to_string(), waited: deadline.budget() });
            }
            map = self.changed.wait_timeout(map, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let r = add_to(&mut self.lock(), key, delta);
        self.changed.notify_all();
        r
    }

    fn check(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.lock().contains_key(key))
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.lock().remove(key).is_some())
    }
}
