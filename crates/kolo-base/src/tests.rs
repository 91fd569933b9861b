use super::*;

#[test]
fn even_split_covers_everything_once() {
    for len in [0usize, 1, 2, 7, 13, 64, 97] {
        for n in 1..=5 {
            let ws = WorldSize::new(n).unwrap();
            let parts: Vec<_> = even_split(len, ws).collect();
            assert_eq!(parts.len(), n);
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[n - 1].end, len);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
            }
            for (i, p) in parts.iter().enumerate() {
                assert_eq!(&shard_range(len, ws, Rank(i)), p);
            }
        }
    }
}

#[test]
fn bytesize_parses_and_prints() {
    assert_eq!("4096".parse::<ByteSize>().unwrap(), ByteSize(4096));
    assert_eq!("4K".parse::<ByteSize>().unwrap(), ByteSize::kib(4));
    assert_eq!("25MiB".parse::<ByteSize>().unwrap(), ByteSize::mib(25));
    assert_eq!("1g".parse::<ByteSize>().unwrap(), ByteSize::gib(1));
    assert!("12X".parse::<ByteSize>().is_err());
    assert!("".parse::<ByteSize>().is_err());
    assert!("99999999999999999999G".parse::<ByteSize>().is_err());
    assert_eq!(ByteSize::mib(256).to_string(), "256 MiB");
    assert_eq!(ByteSize(1536).to_string(), "1.50 KiB");
}

#[test]
fn dtype_codes_round_trip() {
    for d in DType::ALL {
        assert_eq!(DType::from_code(d.code()), Some(d));
        assert_eq!(d.name().parse::<DType>().unwrap(), d);
    }
    assert_eq!(DType::from_code(0), None);
    assert_eq!(DType::from_code(200), None);
}

#[test]
fn deadline_never_panics_on_huge_budgets() {
    let d = Deadline::after(Duration::MAX);
    assert!(!d.expired());
    let d = Deadline::after(Duration::ZERO);
    assert!(d.expired());
    assert_eq!(d.remaining(), Duration::ZERO);
}

#[test]
fn rng_is_deterministic_and_restorable() {
    let mut a = Rng::new(7);
    let x: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
    let mut b = Rng::new(7);
    assert_eq!(x, (0..5).map(|_| b.next_u64()).collect::<Vec<_>>());
    let mut c = Rng::from_state(a.state());
    assert_eq!(a.next_u64(), c.next_u64());
    let mut v: Vec<u32> = (0..100).collect();
    Rng::new(1).shuffle(&mut v);
    let mut s = v.clone();
    s.sort();
    assert_eq!(s, (0..100).collect::<Vec<_>>());
    assert_ne!(v, s);
    let m: f64 = (0..10_000).map(|_| a.normal()).sum::<f64>() / 10_000.0;
    assert!(m.abs() < 0.05, "{m}");
    assert!((0..1000).all(|_| a.below(3) < 3));
}

/// Two processes writing long lines into one stderr pipe: with `eline!` every line arrives
/// whole (std's `eprintln!` writes the pieces of a format separately, and the lines mixed).
#[test]
fn eline_lines_do_not_interleave_across_processes() {
    const LINES: usize = 2000;
    if let Ok(who) = std::env::var("KOLO_ELINE_CHILD") {
        for i in 0..LINES {
            crate::eline!("{who} {i} {} {} end", "x".repeat(80), who);
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    let children: Vec<_> = ["alpha", "bravo", "charlie"]
        .iter()
        .map(|who| {
            std::process::Command::new(&exe)
                .args(["--exact", "tests::eline_lines_do_not_interleave_across_processes", "--nocapture", "--test-threads=1"])
                .env("KOLO_ELINE_CHILD", who)
                .stdout(std::process::Stdio::null())
                .stderr(writer.try_clone().unwrap())
                .spawn()
                .unwrap()
        })
        .collect();
    drop(writer);
    let mut text = String::new();
    std::io::Read::read_to_string(&mut &reader, &mut text).unwrap();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let ours: Vec<&str> = text.lines().filter(|l| l.ends_with(" end") || l.contains("xxxx")).collect();
    for l in &ours {
        let who = l.split(' ').next().unwrap();
        assert!(l.ends_with(&format!(" {who} end")) && l.matches("xxxx").count() == 20, "a mixed line: {l:?}");
    }
    assert_eq!(ours.len(), 3 * LINES, "every line arrived");
}

/// The clipping norm's sum of squares (eight interleaved f64 lanes) equals the plain f64 sum
/// to rounding, on lengths around the lane count, and is the same on every call.
#[test]
fn sum_of_squares_matches_a_plain_f64_sum() {
    let mut r = Rng::new(3);
    for n in [0usize, 1, 7, 8, 9, 17, 1001, 65_537] {
        let v: Vec<f32> = (0..n).map(|_| r.below(1 << 20) as f32 / 4096.0 - 128.0).collect();
        let plain: f64 = v.iter().map(|x| f64::from(*x) * f64::from(*x)).sum();
        let got = sum_of_squares(&v);
        assert!((got - plain).abs() <= 1e-12 * plain.max(1.0), "n={n}: {got} vs {plain}");
        assert_eq!(got.to_bits(), sum_of_squares(&v).to_bits());
    }
    assert_eq!(sum_of_squares(&[3.0, 4.0]), 25.0);
}
