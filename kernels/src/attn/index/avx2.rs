//! AVX2 + FMA kernels of the indexer scan: eight keys per tile with `vpmaddubsw`, and the scan
//! loops (contiguous runs and gathered positions) that hand 16-key tiles to the VNNI kernels of
//! [`super::avx512`] when the CPU has them.
//!
//! Every `pub(crate)` function is a `#[target_feature(enable = "avx2,fma")]` fn: callers hold
//! a [`crate::level::Verified`] AVX2 level before calling. Loads and stores go through the
//! helpers of [`crate::x86::avx2`], whose bounds come from array types.

use core::arch::x86_64::*;

use kvstack_firmware_interface::IndexMxfp4Entry;

use super::tiles::{KEY_LANES, KEY_LUT, SPREAD_LINES, TILE_LINES, TileLines};
use super::{IndexQuery, Prepared, score_exact};
use crate::attn::Paged;
use crate::level::Vnni;
use crate::x86::avx2::{ld_ps, ld_si256, st_ps, st_si256};

#[inline]
#[target_feature(enable = "avx2,fma")]
fn ld_u32x8(a: &[u32; 8]) -> __m256i {
    // SAFETY: `a` is 8 readable u32 (32 bytes); any alignment.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// A 32-byte aligned value, so that vector loads of it never split a cache line.
#[repr(C, align(32))]
struct A32<T>(T);

/// Transposes an 8 x 8 block: lane `e` of result `i` is lane `i` of `v[e]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn transpose8x8(v: [__m256; 8]) -> [__m256; 8] {
    let [r0, r1, r2, r3, r4, r5, r6, r7] = v;
    let t0 = _mm256_unpacklo_ps(r0, r1);
    let t1 = _mm256_unpackhi_ps(r0, r1);
    let t2 = _mm256_unpacklo_ps(r2, r3);
    let t3 = _mm256_unpackhi_ps(r2, r3);
    let t4 = _mm256_unpacklo_ps(r4, r5);
    let t5 = _mm256_unpackhi_ps(r4, r5);
    let t6 = _mm256_unpacklo_ps(r6, r7);
    let t7 = _mm256_unpackhi_ps(r6, r7);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// `t_{2c} + t_{2c+1}` for all 32 heads (four vectors) of one decoded key: the two blocks of
/// packed chunk `c` are multiplied side by side (eight i16 accumulators), widened, offset,
/// scaled by `2^(eq - 127)` and by the key's `2^(ek - 129)` (`sk0`, `sk1`), all exactly, and
/// added with one rounding (exact under the fast-path conditions). A macro so that both
/// halves are inlined into [`key_heads`] (LLVM does not inline a `#[target_feature]` function
/// this large, and `#[inline(always)]` is not allowed on one).
macro_rules! block_pair {
    ($p:expr, $kb:expr, $c:literal, $sk0:expr, $sk1:expr) => {{
        let (p, kb): (&Prepared, &[[u32; 8]; 4]) = ($p, $kb);
        let (b0, b1) = (2 * $c, 2 * $c + 1);
        let (q0, q1) = (&p.qv[b0], &p.qv[b1]);
        let mut a0 = [_mm256_setzero_si256(); 4];
        let mut a1 = [_mm256_setzero_si256(); 4];
        for g in 0..8 {
            let row = &kb[2 * $c + g / 4];
            let k0 = _mm256_set1_epi32(row[g % 4] as i32);
            let k1 = _mm256_set1_epi32(row[4 + g % 4] as i32);
            for r in 0..4 {
                a0[r] = _mm256_add_epi16(a0[r], _mm256_maddubs_epi16(k0, ld_si256(&q0[g][r])));
                a1[r] = _mm256_add_epi16(a1[r], _mm256_maddubs_epi16(k1, ld_si256(&q1[g][r])));
            }
        }
        let ones = _mm256_set1_epi16(1);
        let (s0, s1) = (_mm256_set1_ps($sk0), _mm256_set1_ps($sk1));
        let pair: [__m256; 4] = std::array::from_fn(|r| {
            // `(I_raw - off) * 2^(eq - 127)` as one fused multiply-add of exact operands
            // (`I_raw * sq` and `-off * sq` are exact); its exact result is an integer below
            // 2^13 times a power of two, so the single rounding is exact too. Then
            // `* 2^(ek - 129)`.
            let i0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(a0[r], ones));
            let i1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(a1[r], ones));
            let u0 = _mm256_fmadd_ps(i0, ld_ps(&p.sq[b0][r]), ld_ps(&p.offsq[b0][r]));
            let u1 = _mm256_fmadd_ps(i1, ld_ps(&p.sq[b1][r]), ld_ps(&p.offsq[b1][r]));
            _mm256_fmadd_ps(u1, s1, _mm256_mul_ps(u0, s0))
        });
        pair
    }};
}

/// The weighted head terms `T_h = w[h] * relu(d[h])` of one decoded key, heads `8r..8r+8` in
/// vector `r`, with `d = (t_0 + t_1) + (t_2 + t_3)`. Kept out of line: inlined into the loop
/// over eight keys, LLVM hoists the loop-invariant query loads and spills them.
#[inline(never)]
#[target_feature(enable = "avx2,fma")]
fn key_heads(p: &Prepared, kb: &[[u32; 8]; 4], sk: [f32; 4], x: &mut [__m256; 4]) {
    let p01 = block_pair!(p, kb, 0, sk[0], sk[1]);
    let p23 = block_pair!(p, kb, 1, sk[2], sk[3]);
    let zero = _mm256_setzero_ps();
    for (r, xr) in x.iter_mut().enumerate() {
        let d = _mm256_add_ps(p01[r], p23[r]);
        *xr = _mm256_mul_ps(_mm256_max_ps(d, zero), ld_ps(&p.w[r]));
    }
}

/// Scores eight keys with the integer kernel; `false` (and nothing written) when the tile's
/// scale exponents are outside the window where the f32 combine is exact (see
/// [`IndexQuery`]), so the caller must use the exact path.
///
/// Lanes are heads: per key, each 4-byte group of decoded key values (`2k + 12`) is broadcast
/// and multiplied with the matching group of all 32 query heads (four vectors of eight heads,
/// `vpmaddubsw`, exact) and summed in i16 over the block's eight groups (at most 4608 in
/// magnitude); `vpmaddwd` widens to i32, the offset is removed, and the block scales are
/// applied in f32 (exact, see [`IndexQuery`]). The heads are then weighted and summed in head
/// order (see the [module documentation](crate::attn)).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn index_tile8(p: &Prepared, keys: &[&IndexMxfp4Entry; 8], out: &mut [f32; 8]) -> bool {
    let Some(lim) = p.fast else {
        return false;
    };
    // Scale bytes: lane e holds key e's four bytes.
    let sc = A32(keys.map(|k| u32::from_le_bytes(k.scales)));
    let s = ld_u32x8(&sc.0);
    let m = _mm256_set1_epi32(0xFF);
    let e = [
        _mm256_and_si256(s, m),
        _mm256_and_si256(_mm256_srli_epi32::<8>(s), m),
        _mm256_and_si256(_mm256_srli_epi32::<16>(s), m),
        _mm256_srli_epi32::<24>(s),
    ];
    let emin = _mm256_min_epi32(_mm256_min_epi32(e[0], e[1]), _mm256_min_epi32(e[2], e[3]));
    let emax = _mm256_max_epi32(_mm256_max_epi32(e[0], e[1]), _mm256_max_epi32(e[2], e[3]));
    let bad = _mm256_or_si256(
        _mm256_or_si256(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lim.kmin), emin),
            _mm256_cmpgt_epi32(emax, _mm256_set1_epi32(lim.kmax)),
        ),
        _mm256_cmpgt_epi32(_mm256_sub_epi32(emax, emin), _mm256_set1_epi32(lim.kspan)),
    );
    if _mm256_movemask_epi8(bad) != 0 {
        return false;
    }
    // 2^(ek - 129) = 2^(ek - 127) / 4: the key's scale and the 1/4 of `2k * 2q`; normal
    // since ek >= kmin >= 3. `sk[b][e]`.
    let two = _mm256_set1_epi32(2);
    let mut sk = A32([[0f32; 8]; 4]);
    for (d, x) in sk.0.iter_mut().zip(e) {
        st_ps(
            d,
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(x, two))),
        );
    }

    let lut = ld_si256(zerocopy::transmute_ref!(&KEY_LUT));
    let nib = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_ps();
    // Decoded keys, all eight first (so that no broadcast below waits on a recent store):
    // kb[e][2c] = low nibbles (even elements) and kb[e][2c + 1] = high nibbles (odd elements)
    // of packed bytes 32c..32c+32 of key e, as `2k + 12`.
    let mut kb = A32([[[0u32; 8]; 4]; 8]);
    for (k, kbe) in keys.iter().zip(kb.0.iter_mut()) {
        let v: &[[u8; 32]; 2] = zerocopy::transmute_ref!(&k.values);
        for (c, vc) in v.iter().enumerate() {
            let pk = ld_si256(vc);
            let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(pk, nib));
            let hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(pk), nib));
            for (d, x) in kbe.iter_mut().skip(2 * c).zip([lo, hi]) {
                st_si256(zerocopy::transmute_mut!(d), x);
            }
        }
    }
    let mut xs = [[zero; 4]; 8];
    for (ki, (kb, x)) in kb.0.iter().zip(xs.iter_mut()).enumerate() {
        let skey = [sk.0[0][ki], sk.0[1][ki], sk.0[2][ki], sk.0[3][ki]];
        key_heads(p, kb, skey, x);
    }
    // The head sum in head order, eight keys at once: transposed so that lanes are keys,
    // `s = T_0; s = s + T_h` for h = 1..32.
    let cols: [[__m256; 8]; 4] = std::array::from_fn(|r| std::array::from_fn(|e| xs[e][r]));
    let mut total: Option<__m256> = None;
    for col in cols {
        for t in transpose8x8(col) {
            total = Some(total.map_or(t, |s| _mm256_add_ps(s, t)));
        }
    }
    let total = total.unwrap_or(zero);
    st_ps(out, total);
    true
}

/// How far ahead of the keys being scored the scan prefetches into L1, in bytes (32 keys,
/// about 3 us of work: far more than a DRAM latency). A second prefetch into L2 runs eight
/// times farther ahead, across the 4 KiB page boundaries where the hardware stream
/// prefetcher stops.
const KEY_PREFETCH: usize = 32 * IndexMxfp4Entry::BYTES;

/// A partial tile of `N` gathered keys with their destinations.
struct Carry<'a, const N: usize> {
    keys: [(usize, Option<&'a IndexMxfp4Entry>); N],
    n: usize,
    vnni: Option<Vnni>,
}

impl<'a, const N: usize> Carry<'a, N> {
    fn new(vnni: Option<Vnni>) -> Self {
        Carry {
            keys: [(usize::MAX, None); N],
            n: 0,
            vnni,
        }
    }

    /// Adds a key; scores the tile once it holds `N`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn push(&mut self, q: &IndexQuery, d: usize, k: &'a IndexMxfp4Entry, out: &mut [f32]) {
        if let Some(slot) = self.keys.get_mut(self.n) {
            *slot = (d, Some(k));
        }
        self.n += 1;
        if self.n == N {
            self.flush(q, out);
        }
    }

    /// Scores the held keys (a partial tile is padded with copies of its first key).
    #[target_feature(enable = "avx2,fma")]
    fn flush(&mut self, q: &IndexQuery, out: &mut [f32]) {
        let n = self.n;
        self.n = 0;
        // Slots fill in order, so the first holds a key unless the carry is empty.
        let Some(first) = self.keys[0].1 else {
            debug_assert_eq!(n, 0, "a held key in a later slot only");
            return;
        };
        // A loop rather than `self.keys.map(..)`, which rustc left out of line.
        let mut keys = [first; N];
        for (k, (_, held)) in keys.iter_mut().zip(&self.keys) {
            *k = held.unwrap_or(first);
        }
        let mut s = [0f32; N];
        score_tile(q, &keys, self.vnni, &mut s);
        for ((d, _), &v) in self.keys.iter().zip(&s).take(n) {
            if let Some(o) = out.get_mut(*d) {
                *o = v;
            }
        }
        self.keys = [(usize::MAX, None); N];
    }
}

/// Scores a tile of `N` keys: with VNNI (and `N` a multiple of 16) sixteen keys per kernel
/// call, lanes = keys ([`super::avx512::index_tile16`]); otherwise eight per call of the AVX2
/// kernel. A sub-tile the integer kernel declines goes through the exact path.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn score_tile<const N: usize>(
    q: &IndexQuery,
    keys: &[&IndexMxfp4Entry; N],
    vnni: Option<Vnni>,
    out: &mut [f32; N],
) {
    const L: usize = KEY_LANES;
    match vnni {
        Some(v) if N.is_multiple_of(L) => {
            for (k, o) in keys
                .as_chunks::<L>()
                .0
                .iter()
                .zip(out.as_chunks_mut::<L>().0)
            {
                score16(q, k, v, o, None);
            }
        }
        _ => {
            for (k, o) in keys
                .as_chunks::<8>()
                .0
                .iter()
                .zip(out.as_chunks_mut::<8>().0)
            {
                *o = score8(q, k);
            }
        }
    }
}

/// Sixteen scores with VNNI: the fused kernel (prefetching the first [`SPREAD_LINES`] of
/// `lines` as it goes), else the per-block kernel, else the exact path. A tile the fused
/// kernel declines has those lines prefetched here instead.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn score16(
    q: &IndexQuery,
    keys: &[&IndexMxfp4Entry; KEY_LANES],
    v: Vnni,
    out: &mut [f32; KEY_LANES],
    lines: Option<&TileLines>,
) {
    // SAFETY: a `Vnni` token exists only when this CPU has AVX-512 F/BW/VL and VNNI
    // (`Vnni::detect`), which is what both kernels are compiled for; the fused kernel also
    // needs VBMI, which `Vnni::vbmi` reports.
    if unsafe { v.vbmi() && super::avx512::index_tile16_fused(&q.prep, keys, out, lines) } {
        return;
    }
    for &a in lines.into_iter().flat_map(|l| l.iter().take(SPREAD_LINES)) {
        // A prefetch never faults and has no effect visible to Rust.
        _mm_prefetch::<_MM_HINT_T0>(a);
    }
    // SAFETY: as above.
    if !unsafe { super::avx512::index_tile16(&q.prep, keys, out) } {
        for (x, key) in out.iter_mut().zip(keys) {
            *x = score_exact(q, key);
        }
    }
}

/// Eight scores: the integer kernel, or the exact path for a tile it declines.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn score8(q: &IndexQuery, keys: &[&IndexMxfp4Entry; 8]) -> [f32; 8] {
    let mut s = A32([0f32; 8]);
    if !index_tile8(&q.prep, keys, &mut s.0) {
        for (o, k) in s.0.iter_mut().zip(keys) {
            *o = score_exact(q, k);
        }
    }
    s.0
}

/// Positions a gathered scan resolves to keys at once: four tiles of 16 (or eight of 8).
const GATHER_BATCH: usize = 64;
/// Keys scored between two prefetch steps of a gathered scan: one 16-key tile.
const GATHER_STEP: usize = 16;
// A step is one call of the VNNI kernels, which can take the step's prefetches.
const _: () = assert!(GATHER_STEP == KEY_LANES);
/// How many batches ahead a gathered scan resolves positions and touches each block's first
/// line (about 3.5 us of scoring; 2 to 16 measured the same).
const GATHER_FAR: usize = 3;
/// Resolved batches a gathered scan holds: the one scored and those up to [`GATHER_FAR`].
const GATHER_RING: usize = GATHER_FAR + 1;
/// Tiles of a batch, one per prefetch step.
const STEPS: usize = GATHER_BATCH / GATHER_STEP;

/// The index of a tile in a batch, below [`STEPS`]: made only by [`Step::all`], so every
/// batch has the tile of every `Step`.
#[derive(Clone, Copy, Debug)]
struct Step(usize);

impl Step {
    /// Every step of a batch, in order.
    fn all() -> impl Iterator<Item = Step> {
        (0..STEPS).map(Step)
    }
}

/// Bits `d..d + n` of a batch's validity mask (`d + n <= GATHER_BATCH`).
#[inline]
fn run_mask(d: usize, n: usize) -> u64 {
    let ones = u64::MAX.checked_shr((GATHER_BATCH - n.min(GATHER_BATCH)) as u32);
    ones.unwrap_or(0).checked_shl(d as u32).unwrap_or(0)
}

/// A batch of a gathered scan, in tiles of [`GATHER_STEP`]: `refs[t][j]` is the key of the
/// batch's position `i = GATHER_STEP * t + j` where bit `i` of `valid` is set; other slots hold
/// a stand-in key, scored but never written out.
struct Batch<'a> {
    refs: [[&'a IndexMxfp4Entry; GATHER_STEP]; STEPS],
    valid: u64,
}

impl<'a> Batch<'a> {
    /// A batch with no valid position.
    fn empty(stand_in: &'a IndexMxfp4Entry) -> Self {
        Batch {
            refs: [[stand_in; GATHER_STEP]; STEPS],
            valid: 0,
        }
    }

    /// Makes this the batch of `positions` (at most [`GATHER_BATCH`]); positions outside
    /// `0..visible` (with `visible <= keys.len()`) stay invalid. One page lookup per run of
    /// consecutive positions (a candidate pool lists whole blocks), none per key. In place:
    /// returning a new batch (520 bytes) and moving it through the ring copied it twice.
    #[inline]
    fn resolve(
        &mut self,
        keys: Paged<'a, IndexMxfp4Entry>,
        visible: usize,
        positions: &[i32],
        stand_in: &'a IndexMxfp4Entry,
    ) {
        *self = Batch::empty(stand_in);
        let b = self;
        let valid = |p: i32| usize::try_from(p).ok().filter(|&p| p < visible);
        let mut i = 0;
        while let Some(&p) = positions.get(i) {
            // A whole pool block in one page: its 8 references at once, with no run lookup
            // (1.06-1.09x faster scans of a pool than the general path below, measured).
            if let Some(block) = Self::block(keys, visible, positions.get(i..i + 8))
                && let Some(slots) = b.refs.as_flattened_mut().get_mut(i..i + 8)
            {
                slots.copy_from_slice(&block.each_ref());
                b.valid |= run_mask(i, 8);
                i += 8;
                continue;
            }
            let Some(start) = valid(p) else {
                i += 1;
                continue;
            };
            // Other runs (a block across pages or the visible end, scattered keys) are
            // rare enough to extend one position at a time.
            let mut len = 1;
            while positions
                .get(i + len)
                .and_then(|&x| valid(x))
                .is_some_and(|x| x == start + len)
            {
                len += 1;
            }
            for (s, run) in keys.runs(start..start + len) {
                let d = i + s - start;
                let mut n = 0;
                for (r, k) in b.refs.as_flattened_mut().iter_mut().skip(d).zip(run) {
                    *r = k;
                    n += 1;
                }
                b.valid |= run_mask(d, n);
            }
            i += len;
        }
    }

    /// The keys of `positions` when they are 8 consecutive visible positions in one page (a
    /// pool block, spec §4).
    #[inline]
    fn block(
        keys: Paged<'a, IndexMxfp4Entry>,
        visible: usize,
        positions: Option<&[i32]>,
    ) -> Option<&'a [IndexMxfp4Entry; 8]> {
        let p: &[i32; 8] = positions?.try_into().ok()?;
        let first = p[0];
        first.checked_add(7)?;
        // Compared in registers: each position against its expected value.
        if !p.iter().zip(first..).all(|(&x, want)| x == want) {
            return None;
        }
        let start = usize::try_from(first).ok()?;
        if start + 8 > visible {
            return None;
        }
        keys.array::<8>(start)
    }

    /// The keys of tile `step`.
    #[inline]
    fn tile(&self, step: Step) -> &[&'a IndexMxfp4Entry; GATHER_STEP] {
        &self.refs[step.0]
    }

    /// Prefetches into L1 the first line of each 8-key block (a pool block, spec §4) of tile
    /// `step`, and of its last key where the block crosses into another 4 KiB page.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn prefetch_blocks(&self, step: Step) {
        let tile = self.tile(step);
        for block in tile.as_chunks::<8>().0 {
            let first = std::ptr::from_ref(block[0]).cast::<i8>();
            let last = std::ptr::from_ref(block[7]).cast::<i8>();
            // A prefetch never faults and has no effect visible to Rust; both addresses lie
            // inside a key.
            _mm_prefetch::<_MM_HINT_T0>(first);
            if first.addr() >> 12 != last.addr() >> 12 {
                _mm_prefetch::<_MM_HINT_T0>(last);
            }
        }
    }

    /// Prefetches into L1 the cache lines of the keys of tile `step`: the first line of each
    /// 68-byte key and the one 64 bytes on. Within a run that covers every line (a key that
    /// reaches a third line ends in the next key's first one); only the last key of a run
    /// may, 3 times in 64, leave its last 4 bytes to a demand miss. Stand-ins are prefetched
    /// too: branching on validity cost more than it saved.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn prefetch_step(&self, step: Step) {
        let tile = self.tile(step);
        for &k in tile {
            let p = std::ptr::from_ref(k).cast::<i8>();
            // A prefetch never faults and has no effect visible to Rust; both addresses lie
            // inside the key.
            _mm_prefetch::<_MM_HINT_T0>(p);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
        }
    }

    /// Writes into `lines` the cache lines of the keys of tile `step`, in address order
    /// within each half of the tile, and returns how many entries to prefetch (the fused
    /// kernel takes the first [`SPREAD_LINES`]): what the kernel prefetches while it scores
    /// another tile. When each half is one run of consecutive keys in memory (a pool block,
    /// 9 or 10 lines), each half fills [`SPREAD_LINES`]` / 2` entries with its range of
    /// lines, the last repeated (the same line prefetched twice costs one fetch); built
    /// without branches and straight into `lines`, this costs less than the general list
    /// (1.03-1.07x faster scans of a pool, measured). Otherwise each key adds its first line
    /// and the line of its last byte unless the previous key ended in it, entries up to
    /// [`SPREAD_LINES`] padded with the last line.
    #[inline]
    fn tile_lines(&self, step: Step, lines: &mut TileLines) -> usize {
        const HALF: usize = GATHER_STEP / 2;
        /// Lines per half in the pool case: a run of 8 keys spans at most 10 lines.
        const PER: usize = SPREAD_LINES / 2;
        const _: () = assert!((63 + HALF * IndexMxfp4Entry::BYTES).div_ceil(64) <= PER);
        let line_of = |a: *const i8| a.wrapping_sub(a.addr() % 64);
        let tile = self.tile(step);
        // Each half's first byte and last byte.
        let bounds = |half: &[&IndexMxfp4Entry; HALF]| {
            let first = std::ptr::from_ref(half[0]).cast::<i8>();
            let end = std::ptr::from_ref(half[HALF - 1])
                .cast::<i8>()
                .wrapping_add(IndexMxfp4Entry::BYTES - 1);
            (first, end)
        };
        let halves = tile.as_chunks::<HALF>().0;
        let is_run = |(first, end): (*const i8, *const i8)| {
            end.addr().wrapping_sub(first.addr()) == HALF * IndexMxfp4Entry::BYTES - 1
        };
        if halves.iter().all(|h| is_run(bounds(h))) {
            for (half, slots) in halves.iter().zip(lines.as_chunks_mut::<PER>().0) {
                let (first, end) = bounds(half);
                let base = line_of(first);
                let span = line_of(end).addr().wrapping_sub(base.addr());
                for (i, slot) in slots.iter_mut().enumerate() {
                    *slot = base.wrapping_add((64 * i).min(span));
                }
            }
            return SPREAD_LINES;
        }
        let mut n = 0;
        let mut last: Option<*const i8> = None;
        let mut push = |line: *const i8| {
            if last.is_none_or(|l| l.addr() != line.addr()) {
                if let Some(slot) = lines.get_mut(n) {
                    *slot = line;
                }
                n += 1;
                last = Some(line);
            }
        };
        for half in halves {
            let (first, end) = bounds(half);
            if is_run((first, end)) {
                let mut line = line_of(first);
                while line.addr() <= end.addr() {
                    push(line);
                    line = line.wrapping_add(64);
                }
            } else {
                for &k in half {
                    let p = std::ptr::from_ref(k).cast::<i8>();
                    push(line_of(p));
                    push(line_of(p.wrapping_add(IndexMxfp4Entry::BYTES - 1)));
                }
            }
        }
        let pad = last.unwrap_or(std::ptr::null());
        for slot in lines.iter_mut().take(SPREAD_LINES).skip(n) {
            *slot = pad;
        }
        n
    }
}

/// Scores the keys at `positions` into `out` (`out[i]` for `positions[i]`; positions outside
/// `0..visible` are left alone), in batches of [`GATHER_BATCH`] positions whose tiles go
/// straight to the kernel. Batches are resolved to key references [`GATHER_FAR`] batches
/// ahead of their scoring. While a batch's tiles are scored, two kinds of prefetch run ahead,
/// one tile's worth per step: the first line of every pool block (8 keys) of the batch
/// `GATHER_FAR` ahead, and every line of the next batch. The far touches pay each block's
/// page walk and DRAM latency early, so that the near ones, which fetch the rest, complete in
/// time; either kind alone left a cold pool's load time on top of the scoring.
///
/// With the fused VNNI kernel the near lines (18-20 a tile) go to the kernel, which issues
/// them in four groups spread through its integer loop: issued at once before the tile they
/// outnumbered the core's L1 miss buffers, and the prefetch that found none free held up the
/// scoring (in one thread a cold pool took about 1.4x its time from L2; spread, about 1.1x).
/// See docs/attention-kernels.md, "Gathered scans".
#[target_feature(enable = "avx2,fma")]
pub(crate) fn score_positions<'k>(
    q: &IndexQuery,
    keys: Paged<'k, IndexMxfp4Entry>,
    visible: usize,
    positions: &[i32],
    vnni: Option<Vnni>,
    out: &mut [f32],
) {
    // `super::gather` returns an error for any other length.
    debug_assert_eq!(out.len(), positions.len(), "one score per position");
    let visible = visible.min(keys.len());
    // No visible key: every position is invalid, and `out` stays as the caller filled it.
    let Some(stand_in) = keys.get(0).filter(|_| visible > 0) else {
        return;
    };
    // Whether the fused kernel can serve this query (it may still decline single tiles).
    let spread = vnni.is_some_and(Vnni::vbmi) && q.prep.fused.is_some();
    let n_batches = positions.len().div_ceil(GATHER_BATCH);
    let range_of = |b: usize| {
        let lo = (b * GATHER_BATCH).min(positions.len());
        lo..(lo + GATHER_BATCH).min(positions.len())
    };
    let resolve = |batch: &mut Batch<'k>, b: usize| {
        let p = positions.get(range_of(b)).unwrap_or_default();
        batch.resolve(keys, visible, p, stand_in);
    };
    let mut ring: [Batch<'k>; GATHER_RING] = std::array::from_fn(|_| Batch::empty(stand_in));
    for b in 0..GATHER_FAR.min(n_batches) {
        let batch = &mut ring[b % GATHER_RING];
        resolve(batch, b);
        for step in Step::all() {
            batch.prefetch_blocks(step);
            if b == 0 {
                batch.prefetch_step(step);
            }
        }
    }
    for b in 0..n_batches {
        if b + GATHER_FAR < n_batches {
            resolve(&mut ring[(b + GATHER_FAR) % GATHER_RING], b + GATHER_FAR);
        }
        let cur = &ring[b % GATHER_RING];
        let Some(o) = out.get_mut(range_of(b)) else {
            continue;
        };
        if cur.valid == 0 {
            continue;
        }
        let near = (b + 1 < n_batches).then(|| &ring[(b + 1) % GATHER_RING]);
        let far = (b + GATHER_FAR < n_batches).then(|| &ring[(b + GATHER_FAR) % GATHER_RING]);
        let score = |dst: &mut [f32]| {
            // Filled per tile by `tile_lines`; kept across tiles, not rebuilt.
            let mut lines: TileLines = [std::ptr::null(); TILE_LINES];
            let steps = Step::all()
                .zip(&cur.refs)
                .zip(dst.as_chunks_mut::<GATHER_STEP>().0);
            for ((step, t), st) in steps {
                if let Some(f) = far {
                    f.prefetch_blocks(step);
                }
                match (near, vnni) {
                    (Some(n), Some(v)) if spread => {
                        let count = n.tile_lines(step, &mut lines);
                        // Lines beyond what the kernel takes (keys scattered rather than
                        // in pool blocks) are prefetched now.
                        for &a in lines.get(SPREAD_LINES..count).into_iter().flatten() {
                            // A prefetch never faults and has no effect visible to Rust.
                            _mm_prefetch::<_MM_HINT_T0>(a);
                        }
                        score16(q, t, v, st, Some(&lines));
                    }
                    _ => {
                        if let Some(n) = near {
                            n.prefetch_step(step);
                        }
                        score_tile(q, t, vnni, st);
                    }
                }
            }
        };
        if cur.valid == u64::MAX && o.len() == GATHER_BATCH {
            // Every position valid: straight into the output.
            score(o);
        } else {
            let mut s = [0f32; GATHER_BATCH];
            score(&mut s);
            for (i, (o, v)) in o.iter_mut().zip(s).enumerate() {
                if cur.valid >> i & 1 == 1 {
                    *o = v;
                }
            }
        }
    }
}

/// Scores runs of consecutive keys, run `(d, keys)` into `out[d..d + keys.len()]`: whole tiles
/// straight from each run (with prefetching ahead), keys left over at run ends through a
/// carried tile.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn score_runs<'a>(
    q: &IndexQuery,
    runs: impl Iterator<Item = (usize, &'a [IndexMxfp4Entry])>,
    vnni: Option<Vnni>,
    out: &mut [f32],
) {
    if vnni.is_some() {
        score_runs_n::<{ KEY_LANES }>(q, runs, vnni, out);
    } else {
        score_runs_n::<8>(q, runs, vnni, out);
    }
}

/// [`score_runs`] in tiles of `N` keys, prefetching the memory past each tile (where the runs
/// of a contiguous scan continue).
#[target_feature(enable = "avx2,fma")]
fn score_runs_n<'a, const N: usize>(
    q: &IndexQuery,
    runs: impl Iterator<Item = (usize, &'a [IndexMxfp4Entry])>,
    vnni: Option<Vnni>,
    out: &mut [f32],
) {
    let mut carry = Carry::<N>::new(vnni);
    for (d0, run) in runs {
        // Complete a pending tile first, so that the rest of the run is tile-aligned.
        let lead = if carry.n > 0 {
            (N - carry.n).min(run.len())
        } else {
            0
        };
        let (head, rest) = run.split_at(lead);
        for (i, k) in head.iter().enumerate() {
            carry.push(q, d0 + i, k, out);
        }
        let (tiles, tail) = rest.as_chunks::<N>();
        let mut d = d0 + lead;
        for t in tiles {
            let p = t.as_ptr().cast::<i8>();
            for off in (0..size_of_val(t)).step_by(64) {
                // A prefetch never faults and has no effect visible to Rust; the address may
                // lie past the run, so it is computed with wrapping arithmetic.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(KEY_PREFETCH + off));
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(8 * KEY_PREFETCH + off));
            }
            let mut s = [0f32; N];
            score_tile(q, &t.each_ref(), vnni, &mut s);
            if let Some(o) = out.get_mut(d..d + N) {
                o.copy_from_slice(&s);
            }
            d += N;
        }
        for (i, k) in tail.iter().enumerate() {
            carry.push(q, d + i, k, out);
        }
    }
    carry.flush(q, out);
}

/// Whether the integer kernel accepts a tile (tests check that realistic keys never fall back
/// to the exact path, so the bit-identity tests exercise the kernel).
#[cfg(test)]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn tile_accepted(q: &IndexQuery, keys: &[&IndexMxfp4Entry; 8]) -> bool {
    let mut out = [0f32; 8];
    index_tile8(&q.prep, keys, &mut out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::FromZeros;

    /// The 64-byte lines of a key's bytes.
    fn key_lines(k: &IndexMxfp4Entry) -> std::ops::RangeInclusive<usize> {
        let a = std::ptr::from_ref(k).addr();
        a / 64..=(a + IndexMxfp4Entry::BYTES - 1) / 64
    }

    /// `tile_lines` (prefetch addresses only, so a bug would cost time, not results) lists
    /// every line of a tile's keys and no other, in order, whether a half of the tile is one
    /// run in memory (a range of lines) or not (per key): in a tile of two runs (pool blocks)
    /// within the fused kernel's prefetches, a line possibly repeated; otherwise each line
    /// once, padded with the last one.
    #[test]
    fn tile_lines_lists_every_line_of_a_tile() {
        // Pages allocated one by one, so a run across a page boundary is two runs in memory.
        let pages: Vec<Vec<IndexMxfp4Entry>> = (0..8)
            .map(|_| vec![IndexMxfp4Entry::new_zeroed(); 64])
            .collect();
        for p in &pages {
            assert_eq!(p.as_ptr().addr() % 4, 0, "keys at 4-byte-aligned offsets");
        }
        let refs: Vec<&[IndexMxfp4Entry]> = pages.iter().map(|p| &p[..]).collect();
        let keys = Paged::pages(&refs, 64).unwrap();
        let mut first: Vec<i32> = Vec::new();
        // Tile 0: a pool block, then a block across a page boundary.
        first.extend(16..24);
        first.extend(60..68);
        // Tile 1: scattered keys, then a descending run.
        first.extend([0, 70, 140, 210, 280, 350, 420, 490]);
        first.extend((100..108).rev());
        // Tile 2: two blocks one after the other (one run of 16); tile 3: invalid positions
        // (the batch's stand-in key) around one valid key.
        first.extend(200..216);
        first.extend([-1, 5000, 7, -1, -1, -1, -1, -1]);
        first.extend([-1; 8]);
        // Pool blocks apart in one page, at each offset in a line (68 B keys: a block starts
        // 4 B further into its line per key it is moved by): 9- and 10-line blocks.
        let second: Vec<i32> = [256, 300, 321, 362, 385, 434, 450, 497]
            .iter()
            .flat_map(|&b| b..b + 8)
            .collect();
        let stand_in = keys.get(0).unwrap();
        let mut batch = Batch::empty(stand_in);
        let mut lines: TileLines = [std::ptr::null(); TILE_LINES];
        let (mut run_tiles, mut spans) = (0, std::collections::BTreeSet::new());
        for (which, positions) in [first, second].iter().enumerate() {
            batch.resolve(keys, keys.len(), positions, stand_in);
            for step in Step::all() {
                let tile = batch.tile(step);
                let at = format!("batch {which} tile {}", step.0);
                let mut want: Vec<usize> = Vec::new();
                for k in tile {
                    for line in key_lines(k) {
                        if want.last() != Some(&line) {
                            want.push(line);
                        }
                    }
                }
                let n = batch.tile_lines(step, &mut lines);
                let listed: Vec<usize> = lines.iter().take(n).map(|l| l.addr() / 64).collect();
                let mut got = listed.clone();
                got.dedup();
                assert_eq!(got, want, "{at}");
                let runs = tile.as_chunks::<8>().0.iter().all(|h| {
                    let a = std::ptr::from_ref(h[0]).addr();
                    h.iter().enumerate().all(|(i, k)| {
                        std::ptr::from_ref(*k).addr() == a + i * IndexMxfp4Entry::BYTES
                    })
                });
                if runs {
                    assert_eq!(
                        n, SPREAD_LINES,
                        "{at}: two runs fill the kernel's prefetches"
                    );
                    run_tiles += 1;
                    for h in tile.as_chunks::<8>().0 {
                        spans.insert(key_lines(h[7]).end() + 1 - key_lines(h[0]).start());
                    }
                } else {
                    assert_eq!(listed, want, "{at}: each line once");
                    let last = want.last().copied();
                    for l in lines.iter().take(SPREAD_LINES).skip(n) {
                        assert_eq!(Some(l.addr() / 64), last, "{at} padding");
                    }
                }
            }
        }
        // Tile 2 of the first batch and every tile of the second took the runs' branch, with
        // blocks of both spans.
        assert_eq!(run_tiles, 5);
        assert!(spans.contains(&9) && spans.contains(&10), "{spans:?}");
    }
}
