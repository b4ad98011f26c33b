//! Extra work per request for experiments on the floor (the `experiments` feature), each set by
//! a configuration key and off (0) when absent:
//! - `"floor_spin": N`: N rounds of multiply and xorshift on one register: VM time with no
//!   memory traffic and no host call.
//! - `"floor_touch": N`: N words written at pseudo-random places of a 1 MiB table: VM time that
//!   moves data through the caches.
//! - `"floor_code": N`: N (at most 256) distinct functions of branchy arithmetic, each called
//!   once (~470 bytes of wasm each): VM time spread over much distinct code, as a real filter's
//!   request path is.
//!
//! `scripts/envoy_profile.py --compare-floor NAME=JSON` loads this build beside the plain floor;
//! what each adds to Envoy's own path (not the VM's) tells whether the VM's time, its data or its
//! code footprint slows Envoy down.

/// Words in the `floor_touch` table: 1 MiB.
const TABLE_WORDS: usize = 1 << 17;

#[derive(Default)]
pub struct Experiments {
    /// `floor_spin`: rounds of arithmetic per request.
    spin: u64,
    /// `floor_touch`: words written per request into `table`.
    touch: u64,
    /// 1 MiB of words, allocated when `touch` is set.
    table: Vec<u64>,
    /// `floor_code`: how many of `CODE`'s functions run per request.
    code: usize,
}

impl Experiments {
    /// The experiment keys of a plugin configuration.
    pub fn from_config(raw: &[u8]) -> Self {
        let touch = number_after(raw, b"\"floor_touch\"").unwrap_or(0);
        let code = number_after(raw, b"\"floor_code\"").unwrap_or(0);
        Experiments {
            spin: number_after(raw, b"\"floor_spin\"").unwrap_or(0),
            touch,
            table: if touch > 0 {
                vec![0; TABLE_WORDS]
            } else {
                Vec::new()
            },
            code: usize::try_from(code).unwrap_or(usize::MAX).min(CODE.len()),
        }
    }

    /// One request's extra work; `seed` varies from request to request.
    pub fn run(&mut self, seed: u64) {
        if self.spin > 0 {
            std::hint::black_box(spin(seed, self.spin));
        }
        if self.touch > 0 {
            touch(std::hint::black_box(&mut self.table), seed, self.touch);
        }
        if self.code > 0 {
            let mut x = seed;
            for run in CODE.iter().take(self.code) {
                x = run(x);
            }
            std::hint::black_box(x);
        }
    }
}

/// The JSON unsigned integer after `"key"` (and a colon) in `text`; `None` when absent or not
/// a plain integer.
fn number_after(text: &[u8], key: &[u8]) -> Option<u64> {
    if key.is_empty() {
        return None;
    }
    let at = text.windows(key.len()).position(|w| w == key)? + key.len();
    let rest = text.get(at..)?;
    let rest = rest.get(rest.iter().position(|c| !matches!(c, b' ' | b':'))?..)?;
    let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
    std::str::from_utf8(rest.get(..digits)?).ok()?.parse().ok()
}

/// `floor_spin`'s work: `rounds` of multiply and xorshift on one register.
fn spin(seed: u64, rounds: u64) -> u64 {
    let mut x = seed | 1;
    for _ in 0..rounds {
        x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
    }
    x
}

/// `floor_touch`'s work: `writes` words at pseudo-random places of `table`.
fn touch(table: &mut [u64], seed: u64, writes: u64) {
    let mut x = seed | 1;
    for _ in 0..writes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if let Some(w) = table.get_mut(x as usize % TABLE_WORDS) {
            *w = w.wrapping_add(x);
        }
    }
}

/// One of `floor_code`'s functions: a different instance per `K` (the constants differ, so the
/// compiled code does), never inlined, with branches that depend on the input.
#[inline(never)]
fn code<const K: u64>(mut x: u64) -> u64 {
    const M: u64 = 0x9E37_79B9_7F4A_7C15;
    let k = K.wrapping_mul(M) | 1;
    for i in 0..3u64 {
        x = x.wrapping_mul(k).rotate_left((K % 61 + 1) as u32);
        if x & (1 << (K % 64)) != 0 {
            x ^= k >> (i + 7);
        } else {
            x = x.wrapping_add(K ^ (i << 32));
        }
        x = match (x >> 60) & 3 {
            0 => x.wrapping_sub(k.rotate_left(13)),
            1 => x ^ (k >> 17),
            2 => x.wrapping_mul(K | 3),
            _ => x.rotate_right((K % 29 + 1) as u32),
        };
    }
    x ^ (x >> 31)
}

macro_rules! code_table {
    ($($k:literal)*) => { [$(code::<$k> as fn(u64) -> u64),*] };
}

/// `floor_code`'s functions.
#[rustfmt::skip]
static CODE: [fn(u64) -> u64; 256] = code_table!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95 96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127 128 129 130 131 132 133 134 135 136 137 138 139 140 141 142 143 144 145 146 147 148 149 150 151 152 153 154 155 156 157 158 159 160 161 162 163 164 165 166 167 168 169 170 171 172 173 174 175 176 177 178 179 180 181 182 183 184 185 186 187 188 189 190 191 192 193 194 195 196 197 198 199 200 201 202 203 204 205 206 207 208 209 210 211 212 213 214 215 216 217 218 219 220 221 222 223 224 225 226 227 228 229 230 231 232 233 234 235 236 237 238 239 240 241 242 243 244 245 246 247 248 249 250 251 252 253 254 255);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_experiment_numbers() {
        let raw = br#"{"floor_endpoints":[],"floor_spin": 6000,"floor_touch":12}"#;
        assert_eq!(number_after(raw, b"\"floor_spin\""), Some(6000));
        assert_eq!(number_after(raw, b"\"floor_touch\""), Some(12));
        assert_eq!(number_after(raw, b"\"floor_other\""), None);
        assert_eq!(
            number_after(br#"{"floor_spin":"6"}"#, b"\"floor_spin\""),
            None
        );
        assert_eq!(
            number_after(br#"{"floor_spin":-6}"#, b"\"floor_spin\""),
            None
        );
        let e = Experiments::from_config(br#"{"floor_code": 100000, "floor_touch": 1}"#);
        assert_eq!(
            (e.spin, e.touch, e.code, e.table.len()),
            (0, 1, CODE.len(), TABLE_WORDS)
        );
        let none = Experiments::from_config(br#"{"floor_endpoints":[]}"#);
        assert_eq!(
            (none.spin, none.touch, none.code, none.table.len()),
            (0, 0, 0, 0)
        );
    }

    #[test]
    fn the_experiment_work_is_done() {
        // The rounds change the value (so they are not folded away), and the writes land.
        assert_ne!(spin(7, 10), spin(7, 11));
        let mut table = vec![0u64; TABLE_WORDS];
        touch(&mut table, 7, 100);
        let written = table.iter().filter(|&&w| w != 0).count();
        assert!((90..=100).contains(&written), "{written}");
        // Each code function is its own: one input, 256 different outputs.
        let outs: std::collections::HashSet<u64> = CODE.iter().map(|f| f(12345)).collect();
        assert_eq!(outs.len(), CODE.len());
    }
}
