//! Kolo patch: storage that is filled on demand.
//!
//! A hook registered on a tensor's storage runs before every access to that storage, through
//! the tensor or any view sharing it (a transpose, a broadcast, a reshape: they share the
//! `Arc`). Kolo's ZeRO-3 uses it to train an unchanged model with sharded parameters, as
//! torch's FSDP does with module hooks: a sharded variable's storage is emptied, and the hook
//! gathers the whole values back into it the first time an operation reads it (forward, or
//! backward's use of a saved weight). Nothing changes for a storage without a hook: the check is
//! one relaxed atomic load until the first hook is registered.
//!
//! A hook cannot fail the access it precedes (the accessors return guards, not results): a hook
//! that cannot fill the storage must record its error for its owner to report, and leave values
//! the operation can read (the right number of them).

use crate::backend::BackendDevice;
use crate::{CpuStorage, Result, Storage, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

/// Runs before an access to the storage it is registered on.
pub type StorageHook = Arc<dyn Fn() + Send + Sync>;

/// Whether any hook was ever registered (accesses skip the registry until then).
static ARMED: AtomicBool = AtomicBool::new(false);

/// The hooks by storage key (the address of the storage's lock, stable while the storage lives;
/// the registrant keeps the tensor alive while its hook is registered).
fn registry() -> &'static RwLock<HashMap<usize, StorageHook>> {
    static HOOKS: std::sync::OnceLock<RwLock<HashMap<usize, StorageHook>>> = std::sync::OnceLock::new();
    HOOKS.get_or_init(Default::default)
}

/// Runs the hook of the storage with key `key`, if there is one.
#[inline]
pub(crate) fn before_access(key: usize) {
    if !ARMED.load(Ordering::Relaxed) {
        return;
    }
    let hook = registry().read().unwrap_or_else(|p| p.into_inner()).get(&key).cloned();
    if let Some(hook) = hook {
        hook()
    }
}

impl Tensor {
    /// Registers `hook` to run before every access to this tensor's storage (through any tensor
    /// that shares it), or removes it with `None`. The caller must keep this tensor alive while
    /// the hook is registered. Hooks run on the accessing thread; one that accesses its own
    /// storage bypasses itself only through [`Tensor::replace_storage`] and
    /// [`Tensor::try_release_storage`].
    pub fn set_storage_hook(&self, hook: Option<StorageHook>) {
        let mut hooks = registry().write().unwrap_or_else(|p| p.into_inner());
        match hook {
            Some(h) => {
                hooks.insert(self.storage_key(), h);
                ARMED.store(true, Ordering::Relaxed);
            }
            None => {
                hooks.remove(&self.storage_key());
            }
        }
    }

    /// Replaces this tensor's storage contents (shared with its views) with `storage`, without
    /// running its hook. `storage` must hold exactly the elements of this tensor's contiguous
    /// layout, from offset 0, in its dtype and on its device. Blocks while another thread
    /// reads the storage.
    pub fn replace_storage(&self, storage: Storage) -> Result<()> {
        let layout = self.layout();
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            crate::bail!("replace_storage: the tensor must be contiguous from offset 0")
        }
        if storage.dtype() != self.dtype() || !self.device().is_cpu() {
            crate::bail!("replace_storage: storage of {:?} for a tensor of {:?}", storage.dtype(), self.dtype())
        }
        let n = match &storage {
            Storage::Cpu(c) => cpu_len(c),
            _ => crate::bail!("replace_storage: CPU storage only"),
        };
        if n != layout.shape().elem_count() {
            crate::bail!("replace_storage: {n} elements for a tensor of shape {:?}", layout.shape())
        }
        *self.storage_mut_unhooked() = storage;
        Ok(())
    }

    /// Frees this tensor's storage contents (leaving an empty storage of its dtype), without
    /// running its hook, unless the storage is being read or written right now: then nothing
    /// changes and `false` comes back. Reading the tensor afterwards needs a hook that refills
    /// it with [`Tensor::replace_storage`] first.
    pub fn try_release_storage(&self) -> Result<bool> {
        let Some(mut s) = self.try_storage_mut_unhooked() else { return Ok(false) };
        if !matches!(&*s, Storage::Cpu(_)) {
            crate::bail!("try_release_storage: CPU storage only")
        }
        *s = Storage::Cpu(crate::cpu_backend::CpuDevice.zeros_impl(&crate::Shape::from(0usize), self.dtype())?);
        Ok(true)
    }
}

/// The number of elements a CPU storage holds.
fn cpu_len(c: &CpuStorage) -> usize {
    match c {
        CpuStorage::U8(v) | CpuStorage::F6E2M3(v) | CpuStorage::F6E3M2(v) | CpuStorage::F4(v) | CpuStorage::F8E8M0(v) => v.len(),
        CpuStorage::U32(v) => v.len(),
        CpuStorage::I16(v) => v.len(),
        CpuStorage::I32(v) => v.len(),
        CpuStorage::I64(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::F8E4M3(v) => v.len(),
    }
}
