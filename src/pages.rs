//! Page-aligned buffers that expert reads land in (O_DIRECT needs the alignment), handed back
//! to a pool when the last view of them is dropped, so a stream of experts reuses a few buffers
//! instead of allocating and zeroing one per read.

use std::sync::{Arc, Mutex};

/// 4 KiB aligned to 4 KiB: the unit of buffers that O_DIRECT reads into.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
pub struct Page(pub [u8; 4096]);

/// The bytes of `pages`, in order.
pub fn page_bytes(pages: &[Page]) -> &[u8] {
    // Safety: `Page` is `repr(C)` around a byte array whose size equals its alignment, so the
    // pages are contiguous bytes with no padding, valid for the slice's lifetime.
    unsafe { std::slice::from_raw_parts(pages.as_ptr().cast::<u8>(), pages.len() * 4096) }
}

/// Mutable view of the bytes of `pages`.
pub fn page_bytes_mut(pages: &mut [Page]) -> &mut [u8] {
    // Safety: as in `page_bytes`; the exclusive borrow makes the view the only one.
    unsafe { std::slice::from_raw_parts_mut(pages.as_mut_ptr().cast::<u8>(), pages.len() * 4096) }
}

/// Buffers no read holds, kept for the next reads (at most `keep` of them).
pub struct PagePool {
    free: Mutex<Vec<Vec<Page>>>,
    keep: usize,
}

impl PagePool {
    pub fn new(keep: usize) -> Arc<PagePool> {
        Arc::new(PagePool {
            free: Mutex::new(Vec::new()),
            keep,
        })
    }

    /// A buffer of `pages` pages: a returned one of that size, else a new (zeroed) one. Its
    /// bytes are whatever the last read left there: the reader overwrites what it uses.
    pub fn take(self: &Arc<PagePool>, pages: usize) -> PageBuffer {
        let reused = {
            let mut free = self.free.lock().unwrap();
            free.iter()
                .position(|b| b.len() == pages)
                .map(|i| free.swap_remove(i))
        };
        PageBuffer {
            pages: reused.unwrap_or_else(|| vec![Page([0; 4096]); pages]),
            home: self.clone(),
        }
    }

    /// Buffers waiting for reuse.
    pub fn idle(&self) -> usize {
        self.free.lock().unwrap().len()
    }
}

/// Pages that go back to their pool when dropped.
pub struct PageBuffer {
    pages: Vec<Page>,
    home: Arc<PagePool>,
}

impl PageBuffer {
    pub fn bytes(&self) -> &[u8] {
        page_bytes(&self.pages)
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        page_bytes_mut(&mut self.pages)
    }

    /// The first byte's address, for writers of disjoint ranges (see `experts::reader`).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pages.as_mut_ptr().cast::<u8>()
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        let mut free = self.home.free.lock().unwrap();
        if free.len() < self.home.keep {
            free.push(std::mem::take(&mut self.pages));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_buffers_are_reused_up_to_the_pool_size() {
        let pool = PagePool::new(1);
        let mut first = pool.take(2);
        first.bytes_mut()[5000] = 7;
        let address = first.bytes().as_ptr();
        let second = pool.take(2);
        drop(first);
        drop(second); // over `keep`: freed
        assert_eq!(pool.idle(), 1);
        let again = pool.take(2);
        assert_eq!(again.bytes().as_ptr(), address);
        assert_eq!(again.bytes()[5000], 7, "a reused buffer is not cleared");
        assert_eq!(pool.take(3).bytes().len(), 3 * 4096, "other sizes are new");
    }
}
