//! A small seeded random number generator and the distributions the workloads draw from.
//!
//! The benchmark must replay the *same* workload for every router configuration and on
//! every machine, across crate upgrades. `rand`'s `StdRng` explicitly does not promise a
//! stable stream across versions, so the generator here is SplitMix64 (Steele, Lea and
//! Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014): a dozen lines,
//! a fixed, published output sequence, and good enough statistics for arrival times and
//! length draws.

/// SplitMix64: a fixed, version-independent pseudo-random sequence for a given seed.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

/// SplitMix64's increment, the odd constant from the paper (the golden ratio in 64 bits).
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// A generator whose sequence depends only on `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for a sub-stream (e.g. one per request or per hash block) that does
    /// not overlap the parent's first values in practice: the key is mixed into the seed.
    pub fn derive(seed: u64, key: u64) -> Self {
        Self::new(mix64(seed ^ mix64(key.wrapping_add(GOLDEN_GAMMA))))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// A uniform float in [0, 1) with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        // the top 53 bits fill an f64 mantissa exactly
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform float in (0, 1], safe to take the logarithm of.
    pub fn next_f64_open0(&mut self) -> f64 {
        1.0 - self.next_f64()
    }

    /// A uniform integer in `0..n` (`n > 0`); 0 when `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // multiply-shift (Lemire); the bias for n << 2^64 is negligible for a workload
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// An exponential draw with the given rate (events per unit): Poisson inter-arrivals.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        if rate <= 0.0 {
            return f64::INFINITY;
        }
        -self.next_f64_open0().ln() / rate
    }

    /// A standard normal draw (Box-Muller; one of the pair is discarded for simplicity).
    pub fn standard_normal(&mut self) -> f64 {
        let u1 = self.next_f64_open0();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// SplitMix64's output mix (a variant of MurmurHash3's finaliser); also a good 64-bit
/// integer hash for deriving per-item seeds.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A Zipf (power-law) choice over `n` ranked items: P(rank k) proportional to 1 / k^s.
///
/// Used for LoRA adapter popularity: a few adapters get most of the traffic and a long
/// tail gets a little, which is what multi-tenant LoRA serving reports (S-LoRA, Punica).
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// A Zipf distribution over `n` items with exponent `s` (`s = 0` is uniform).
    pub fn new(n: usize, s: f64) -> Self {
        Self::weighted((1..=n).map(|k| 1.0 / (k as f64).powf(s)))
    }

    /// A choice proportional to the given non-negative weights.
    pub fn weighted(weights: impl IntoIterator<Item = f64>) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = weights
            .into_iter()
            .map(|w| {
                acc += w.max(0.0);
                acc
            })
            .collect();
        if acc > 0.0 {
            for c in &mut cdf {
                *c /= acc;
            }
        }
        Self { cdf }
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.cdf.len()
    }

    /// True when there is nothing to choose from.
    pub fn is_empty(&self) -> bool {
        self.cdf.is_empty()
    }

    /// The index of the chosen item (0 when empty).
    pub fn sample(&self, rng: &mut SplitMix64) -> usize {
        let u = rng.next_f64();
        let i = self.cdf.partition_point(|&c| c <= u);
        i.min(self.cdf.len().saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_different_seed_differs() {
        let a: Vec<u64> = {
            let mut r = SplitMix64::new(7);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = SplitMix64::new(7);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = SplitMix64::new(8);
            (0..5).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn splitmix_matches_reference_output() {
        // Reference values of SplitMix64 seeded with 0 (the C reference by Vigna).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn exponential_mean_is_one_over_rate() {
        let mut r = SplitMix64::new(1);
        let n = 20_000;
        let mean = (0..n).map(|_| r.exponential(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn zipf_rank_one_is_most_popular_and_frequencies_follow_the_law() {
        let z = Zipf::new(10, 1.0);
        let mut r = SplitMix64::new(3);
        let mut counts = [0u32; 10];
        for _ in 0..50_000 {
            counts[z.sample(&mut r)] += 1;
        }
        // P(1)/P(2) = 2 for s = 1
        let ratio = f64::from(counts[0]) / f64::from(counts[1]);
        assert!((ratio - 2.0).abs() < 0.15, "ratio {ratio}");
        assert!(counts[0] > counts[9] * 5);
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = SplitMix64::new(9);
        for n in [1u64, 2, 3, 17, 1000] {
            for _ in 0..200 {
                assert!(r.below(n) < n);
            }
        }
        assert_eq!(r.below(0), 0);
    }
}
