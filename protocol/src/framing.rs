//! A bounded line framer: splits a byte stream into `\n`-terminated lines without ever holding
//! more than one maximum-size line plus one read chunk.
//!
//! The framer is pure; the caller reads into [`LineFramer::buffer_for_read`] and then asks for
//! lines with [`LineFramer::next_line`]. A line that reaches the limit without a newline is
//! reported once as [`LineEvent::TooLong`]; its remaining bytes are discarded up to and including
//! the next newline, where the framer resynchronises.

/// What [`LineFramer::next_line`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum LineEvent<'a> {
    /// A complete line, without its newline.
    Line(&'a [u8]),
    /// A line exceeded the limit. Reported once per offending line.
    TooLong,
}

/// Splits bytes into bounded lines. See the module documentation.
#[derive(Debug)]
pub struct LineFramer {
    buf: Vec<u8>,
    /// Start of the unconsumed bytes in `buf`.
    pos: usize,
    /// Bytes before this offset (relative to `buf`) hold no newline.
    scanned: usize,
    /// Largest line, newline included.
    max_line: usize,
    /// Discarding the tail of an oversize line until the next newline.
    discarding: bool,
    /// `buf.len()` when it was last handed out for a read: what a read appended shows at the
    /// next call.
    filled: usize,
}

/// How much a single read may add to the buffer.
pub const READ_CHUNK: usize = 16 * 1024;

/// Capacity kept while idle, and the room a read gets when the last one was small (a peer
/// sending a message now and then): thousands of idle connections then hold 4 KiB each, not
/// 16. A read of more than half of that earns the next one a whole [`READ_CHUNK`].
const IDLE_CAPACITY: usize = 4 * 1024;

impl LineFramer {
    pub fn new(max_line: usize) -> Self {
        assert!(max_line >= 2, "a line needs room for at least one byte and a newline");
        Self { buf: Vec::new(), pos: 0, scanned: 0, max_line, discarding: false, filled: 0 }
    }

    /// Returns the next complete line or oversize report, or `None` when more input is needed.
    pub fn next_line(&mut self) -> Option<LineEvent<'_>> {
        loop {
            let unscanned = &self.buf[self.scanned..];
            match memchr::memchr(b'\n', unscanned) {
                Some(offset) => {
                    let newline = self.scanned + offset;
                    let start = self.pos;
                    self.pos = newline + 1;
                    self.scanned = self.pos;
                    if self.discarding {
                        self.discarding = false;
                        continue;
                    }
                    if newline - start + 1 > self.max_line {
                        // Reached only when a single chunk carried the whole oversize line.
                        return Some(LineEvent::TooLong);
                    }
                    return Some(LineEvent::Line(&self.buf[start..newline]));
                }
                None => {
                    self.scanned = self.buf.len();
                    if self.discarding {
                        self.buf.clear();
                        self.pos = 0;
                        self.scanned = 0;
                        return None;
                    }
                    if self.buf.len() - self.pos >= self.max_line {
                        self.discarding = true;
                        self.buf.clear();
                        self.pos = 0;
                        self.scanned = 0;
                        return Some(LineEvent::TooLong);
                    }
                    return None;
                }
            }
        }
    }

    /// The next complete line, without taking it; `None` when none is buffered whole (or the
    /// rest of an oversize line is being skipped).
    pub fn peek_line(&self) -> Option<&[u8]> {
        if self.discarding {
            return None;
        }
        // Nothing between `pos` and `scanned` is a newline.
        let newline = self.scanned + memchr::memchr(b'\n', &self.buf[self.scanned..])?;
        Some(&self.buf[self.pos..newline])
    }

    /// Compacts consumed bytes away and reserves room for one read; the caller appends what it
    /// read (at most [`READ_CHUNK`] bytes should be appended before calling
    /// [`next_line`](Self::next_line) again).
    pub fn buffer_for_read(&mut self) -> &mut Vec<u8> {
        let last_read = self.buf.len().saturating_sub(self.filled);
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.scanned -= self.pos;
            self.pos = 0;
        }
        if self.buf.is_empty() && self.buf.capacity() > IDLE_CAPACITY + READ_CHUNK {
            self.buf.shrink_to(IDLE_CAPACITY);
        }
        self.buf.reserve(read_room(last_read, self.buf.is_empty()));
        self.filled = self.buf.len();
        &mut self.buf
    }

    /// Appends bytes directly (for tests and in-memory callers).
    pub fn extend(&mut self, data: &[u8]) {
        self.buffer_for_read().extend_from_slice(data);
    }

    /// Takes what is left after the peer closed: a final line that had no newline.
    pub fn take_remainder(&mut self) -> Option<Vec<u8>> {
        if self.discarding || self.pos >= self.buf.len() {
            self.buf.clear();
            self.pos = 0;
            self.scanned = 0;
            self.discarding = false;
            return None;
        }
        let rest = self.buf[self.pos..].to_vec();
        self.buf.clear();
        self.pos = 0;
        self.scanned = 0;
        Some(rest)
    }

    /// Bytes currently buffered (for memory accounting in tests).
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Current allocation of the buffer.
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }
}

/// The room the next read gets: a whole chunk while a line is in progress or the last read
/// was large (traffic flowing), [`IDLE_CAPACITY`] otherwise. Pure.
fn read_room(last_read: usize, empty: bool) -> usize {
    if !empty || last_read > IDLE_CAPACITY / 2 { READ_CHUNK } else { IDLE_CAPACITY }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(framer: &mut LineFramer) -> Vec<Result<Vec<u8>, ()>> {
        let mut out = Vec::new();
        while let Some(event) = framer.next_line() {
            out.push(match event {
                LineEvent::Line(line) => Ok(line.to_vec()),
                LineEvent::TooLong => Err(()),
            });
        }
        out
    }

    #[test]
    fn peek_shows_the_next_whole_line_without_taking_it() {
        let mut framer = LineFramer::new(16);
        framer.extend(b"ab");
        assert_eq!(framer.peek_line(), None);
        assert!(framer.next_line().is_none());
        framer.extend(b"c\nde");
        assert_eq!(framer.peek_line(), Some(&b"abc"[..]));
        assert!(matches!(framer.next_line(), Some(LineEvent::Line(b"abc"))));
        assert_eq!(framer.peek_line(), None);
        framer.extend(b"\n");
        assert_eq!(framer.peek_line(), Some(&b"de"[..]));
        // The tail of an oversize line being skipped is no line.
        let mut framer = LineFramer::new(4);
        framer.extend(b"xxxxxx");
        assert!(matches!(framer.next_line(), Some(LineEvent::TooLong)));
        framer.extend(b"x\n");
        assert_eq!(framer.peek_line(), None);
        assert!(framer.next_line().is_none());
        framer.extend(b"ok\n");
        assert_eq!(framer.peek_line(), Some(&b"ok"[..]));
    }

    #[test]
    fn splits_lines_across_chunks() {
        let mut framer = LineFramer::new(16);
        framer.extend(b"ab");
        assert!(lines(&mut framer).is_empty());
        framer.extend(b"c\nde\n\nf");
        assert_eq!(lines(&mut framer), vec![Ok(b"abc".to_vec()), Ok(b"de".to_vec()), Ok(vec![])]);
        framer.extend(b"g\n");
        assert_eq!(lines(&mut framer), vec![Ok(b"fg".to_vec())]);
    }

    #[test]
    fn line_at_the_limit_passes_one_byte_over_fails() {
        let mut framer = LineFramer::new(4);
        framer.extend(b"abc\n");
        assert_eq!(lines(&mut framer), vec![Ok(b"abc".to_vec())]);
        framer.extend(b"abcd\nok\n");
        assert_eq!(lines(&mut framer), vec![Err(()), Ok(b"ok".to_vec())]);
    }

    #[test]
    fn oversize_line_is_reported_once_and_resynchronised() {
        let mut framer = LineFramer::new(8);
        let mut reports = 0;
        for _ in 0..100 {
            framer.extend(b"xxxxxxxx");
            reports += lines(&mut framer).len();
            assert!(framer.buffered() <= 8 + READ_CHUNK);
        }
        assert_eq!(reports, 1);
        framer.extend(b"tail\nnext\n");
        assert_eq!(lines(&mut framer), vec![Ok(b"next".to_vec())]);
    }

    /// Reads the way a socket fills what `buffer_for_read` hands out: up to the room.
    fn read(framer: &mut LineFramer, data: &[u8]) -> usize {
        let buf = framer.buffer_for_read();
        let room = buf.capacity() - buf.len();
        let n = data.len().min(room);
        buf.extend_from_slice(&data[..n]);
        n
    }

    #[test]
    fn small_reads_keep_a_small_buffer_and_full_ones_earn_a_chunk() {
        let mut framer = LineFramer::new(64 * 1024);
        // A peer sending a message now and then: the buffer stays at the idle size.
        for _ in 0..10 {
            read(&mut framer, b"{\"frame\":\"hello\"}\n");
            assert_eq!(lines(&mut framer).len(), 1);
            assert!(framer.capacity() <= IDLE_CAPACITY + 64, "{}", framer.capacity());
        }
        // Traffic flowing: a read that filled its room gets a whole chunk next.
        let burst: Vec<u8> = b"0123456789abcde\n".repeat(4 * READ_CHUNK / 16);
        let first = read(&mut framer, &burst);
        assert!(first <= IDLE_CAPACITY + 64);
        lines(&mut framer);
        let second = read(&mut framer, &burst[first..]);
        assert!(second >= READ_CHUNK, "{second}");
    }

    #[test]
    fn remainder_without_newline_is_returned_at_eof() {
        let mut framer = LineFramer::new(8);
        framer.extend(b"one\ntwo");
        assert_eq!(lines(&mut framer), vec![Ok(b"one".to_vec())]);
        assert_eq!(framer.take_remainder(), Some(b"two".to_vec()));
        assert_eq!(framer.take_remainder(), None);
    }
}
