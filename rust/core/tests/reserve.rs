//! `FetchBuffer::reserve` / `commit` / `abandon`: a put written in place.

use lowwater_core::{FetchBuffer, TableError};

#[test]
fn a_committed_reservation_is_a_shard_and_its_bytes_were_counted_meanwhile() {
    for threshold in [0usize, 1 << 30] {
        let buf = FetchBuffer::new(None, threshold);
        let mut pending = buf.reserve("a", "int32", &[4], "owner").unwrap();
        assert_eq!(pending.len(), 16);
        assert!(pending.as_mut_slice().iter().all(|b| *b == 0));
        assert_eq!(buf.stats().bytes, 16); // reserved, not yet an entry
        assert_eq!(buf.stats().entries, 0);
        assert!(!buf.contains("a"));
        pending.as_mut_slice().copy_from_slice(&[7u8; 16]);
        buf.commit(pending).unwrap();
        let shard = buf.get("a").unwrap();
        assert_eq!(shard.payload.as_slice(), &[7u8; 16]);
        assert_eq!(&*shard.owner, "owner");
        assert_eq!(buf.stats().entries, 1);
        assert_eq!(buf.stats().bytes, 16);
        assert_eq!(buf.stats().live_bytes, 16);
    }
}

#[test]
fn abandon_gives_the_reservation_and_the_memory_back() {
    let buf = FetchBuffer::new(Some(100), 0);
    let pending = buf.reserve("a", "uint8", &[80], "").unwrap();
    assert!(matches!(buf.reserve("b", "uint8", &[40], ""), Err(TableError::Full { .. })));
    buf.abandon(pending);
    let s = buf.stats();
    assert_eq!((s.bytes, s.live_bytes, s.entries), (0, 0, 0));
    buf.commit(buf.reserve("b", "uint8", &[40], "").unwrap()).unwrap();
    assert_eq!(buf.stats().bytes, 40);
}

#[test]
fn a_commit_replaces_a_shard_of_the_same_id() {
    let buf = FetchBuffer::new(None, 0);
    buf.put("a", &[1u8; 8], "uint8", &[8], "").unwrap();
    let mut pending = buf.reserve("a", "uint8", &[4], "").unwrap();
    pending.as_mut_slice().copy_from_slice(&[2u8; 4]);
    buf.commit(pending).unwrap();
    assert_eq!(buf.get("a").unwrap().payload.as_slice(), &[2u8; 4]);
    let s = buf.stats();
    assert_eq!((s.entries, s.bytes, s.removals), (1, 4, 1));
}

#[test]
fn reserve_validates_like_put() {
    let buf = FetchBuffer::new(None, 0);
    assert!(matches!(buf.reserve("a", "nope", &[1], ""), Err(TableError::Invalid { .. })));
}

#[test]
fn a_reservation_past_the_huge_page_size_is_zeroed_writable_and_read_back() {
    // 3 huge pages plus a tail: the huge-page mapping (or, where the kernel
    // refuses the advice, the populated one) must give zeroed memory, take
    // writes to its last byte, and keep them through the freeze to read-only.
    let n = 3 * lowwater_core::payload::HUGE_PAGE_BYTES + 4097;
    let buf = FetchBuffer::new(None, 64 * 1024);
    let mut pending = buf.reserve("big", "uint8", &[n], "").unwrap();
    let slice = pending.as_mut_slice();
    assert_eq!(slice.len(), n);
    assert!(slice.iter().all(|b| *b == 0));
    slice[0] = 1;
    slice[n - 1] = 2;
    buf.commit(pending).unwrap();
    let shard = buf.get("big").unwrap();
    assert!(shard.payload.is_mapped());
    assert_eq!((shard.payload.as_slice()[0], shard.payload.as_slice()[n - 1]), (1, 2));
    drop(shard);
    buf.clear_all();
    assert_eq!(buf.stats().live_bytes, 0);
}
