//! `kolo plot RUN_DIR`: loss and throughput curves of a run, one line per rank, as PNG files.
//! Reads what a run wrote under the directory: TensorBoard event files (`tensorboard_dir`, one
//! run per rank) and JSON-lines logs (`json_log`, `*.jsonl`). Drawn on a pixel buffer with a
//! built-in 5x7 font and encoded with the `png` crate. Not `plotters`: it draws text through a
//! system font (font-kit) or an embedded TTF, and a static binary on a headless machine has
//! neither; the curves need a handful of labels, which the built-in font covers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Curves by name ("loss", "samples/s"), each a line per source (rank): (step, value).
pub type Curves = BTreeMap<String, BTreeMap<String, Vec<(f64, f64)>>>;

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
}

/// Collects the curves of every log under `dir`.
pub fn collect(dir: &Path) -> Result<Curves, String> {
    let mut files = Vec::new();
    walk(dir, &mut files);
    let mut curves = Curves::new();
    let mut add = |curve: &str, line: String, step: f64, v: f64| {
        if v.is_finite() {
            curves.entry(curve.to_string()).or_default().entry(line).or_default().push((step, v));
        }
    };
    for f in &files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let line = f
            .strip_prefix(dir)
            .unwrap_or(f)
            .parent()
            .map(|p| p.display().to_string())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| name.to_string());
        if name.starts_with("events.out.tfevents") {
            for (tag, step, v) in kolo_train::tensorboard::read_scalars(f)? {
                match tag.as_str() {
                    "train/loss" => add("loss", line.clone(), step as f64, f64::from(v)),
                    "train/samples_per_s" => add("samples/s", line.clone(), step as f64, f64::from(v)),
                    _ => {}
                }
            }
        } else if name.ends_with(".jsonl") {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            for l in text.lines() {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else { continue };
                let Some(step) = v.get("step").and_then(|s| s.as_f64()) else { continue };
                let who = v.get("rank").and_then(|r| r.as_u64()).map_or(name.to_string(), |r| format!("rank{r}"));
                if let Some(x) = v.get("loss").and_then(|x| x.as_f64()) {
                    add("loss", who.clone(), step, x);
                }
                if let Some(x) = v.get("samples_per_s").and_then(|x| x.as_f64()) {
                    add("samples/s", who, step, x);
                }
            }
        }
    }
    for lines in curves.values_mut() {
        for pts in lines.values_mut() {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
    }
    if curves.is_empty() {
        return Err(format!(
            "{}: no TensorBoard event files or JSON-lines logs with loss or samples_per_s (set [train] tensorboard_dir or json_log)",
            dir.display()
        ));
    }
    Ok(curves)
}

const W: usize = 800;
const H: usize = 480;
const LEFT: usize = 90;
const RIGHT: usize = 20;
const TOP: usize = 40;
const BOTTOM: usize = 50;

struct Canvas {
    px: Vec<[u8; 3]>,
}

impl Canvas {
    fn new() -> Canvas {
        Canvas { px: vec![[255, 255, 255]; W * H] }
    }
    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            self.px[y as usize * W + x as usize] = c;
        }
    }
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: [u8; 3], thick: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            for t in 0..thick {
                self.set(x, y + t, c);
                self.set(x + t, y, c);
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }
    fn text(&mut self, s: &str, x: i64, y: i64, c: [u8; 3]) {
        for (i, ch) in s.chars().enumerate() {
            let g = glyph(ch.to_ascii_uppercase());
            for (row, bits) in g.iter().enumerate() {
                for col in 0..5 {
                    if bits & (1 << (4 - col)) != 0 {
                        for (ox, oy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                            self.set(x + i as i64 * 12 + col * 2 + ox, y + row as i64 * 2 + oy, c);
                        }
                    }
                }
            }
        }
    }
    fn png(&self, path: &Path) -> Result<(), String> {
        let f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(f), W as u32, H as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().map_err(|e| format!("{}: {e}", path.display()))?;
        let data: Vec<u8> = self.px.iter().flatten().copied().collect();
        w.write_image_data(&data).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// 5x7 glyphs, one row per byte (low 5 bits, leftmost pixel first).
fn glyph(c: char) -> [u8; 7] {
    match c {
        '0' => [14, 17, 19, 21, 25, 17, 14],
        '1' => [4, 12, 4, 4, 4, 4, 14],
        '2' => [14, 17, 1, 2, 4, 8, 31],
        '3' => [30, 1, 1, 14, 1, 1, 30],
        '4' => [2, 6, 10, 18, 31, 2, 2],
        '5' => [31, 16, 30, 1, 1, 17, 14],
        '6' => [6, 8, 16, 30, 17, 17, 14],
        '7' => [31, 1, 2, 4, 8, 8, 8],
        '8' => [14, 17, 17, 14, 17, 17, 14],
        '9' => [14, 17, 17, 15, 1, 2, 12],
        '.' => [0, 0, 0, 0, 0, 12, 12],
        '-' => [0, 0, 0, 31, 0, 0, 0],
        '/' => [1, 1, 2, 4, 8, 16, 16],
        'A' => [14, 17, 17, 31, 17, 17, 17],
        'C' => [14, 17, 16, 16, 16, 17, 14],
        'D' => [28, 18, 17, 17, 17, 18, 28],
        'E' => [31, 16, 16, 30, 16, 16, 31],
        'K' => [17, 18, 20, 24, 20, 18, 17],
        'L' => [16, 16, 16, 16, 16, 16, 31],
        'M' => [17, 27, 21, 21, 17, 17, 17],
        'N' => [17, 25, 21, 19, 17, 17, 17],
        'O' => [14, 17, 17, 17, 17, 17, 14],
        'P' => [30, 17, 17, 30, 16, 16, 16],
        'R' => [30, 17, 17, 30, 20, 18, 17],
        'S' => [15, 16, 16, 14, 1, 1, 30],
        'T' => [31, 4, 4, 4, 4, 4, 4],
        'B' => [30, 17, 17, 30, 17, 17, 30],
        'F' => [31, 16, 16, 30, 16, 16, 16],
        'G' => [14, 17, 16, 23, 17, 17, 15],
        'H' => [17, 17, 17, 31, 17, 17, 17],
        'I' => [14, 4, 4, 4, 4, 4, 14],
        'J' => [7, 2, 2, 2, 2, 18, 12],
        'Q' => [14, 17, 17, 17, 21, 18, 13],
        'U' => [17, 17, 17, 17, 17, 17, 14],
        'V' => [17, 17, 17, 17, 17, 10, 4],
        'W' => [17, 17, 17, 21, 21, 21, 10],
        'X' => [17, 17, 10, 4, 10, 17, 17],
        'Y' => [17, 17, 10, 4, 4, 4, 4],
        'Z' => [31, 1, 2, 4, 8, 16, 31],
        '_' => [0, 0, 0, 0, 0, 0, 31],
        _ => [0; 7],
    }
}

const COLORS: [[u8; 3]; 6] = [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189], [140, 86, 75]];

fn label(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(0.01..100_000.0).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

/// Draws one curve (all its lines) into `path`.
pub fn render(title: &str, lines: &BTreeMap<String, Vec<(f64, f64)>>, path: &Path) -> Result<(), String> {
    let pts = lines.values().flatten();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        return Err(format!("{}: {title}: no points", path.display()));
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + y0.abs().max(1.0) * 0.1;
    }
    let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
    let to = |x: f64, y: f64| -> (i64, i64) {
        ((LEFT as f64 + (x - x0) / (x1 - x0) * pw) as i64, (TOP as f64 + (1.0 - (y - y0) / (y1 - y0)) * ph) as i64)
    };
    let mut c = Canvas::new();
    let grey = [200, 200, 200];
    let black = [0, 0, 0];
    for i in 0..=4 {
        let fy = y0 + (y1 - y0) * i as f64 / 4.0;
        let (_, py) = to(x0, fy);
        c.line((LEFT as i64, py), ((W - RIGHT) as i64, py), grey, 1);
        c.text(&label(fy), 4, py - 7, black);
        let fx = x0 + (x1 - x0) * i as f64 / 4.0;
        let (px, _) = to(fx, y0);
        c.line((px, TOP as i64), (px, (H - BOTTOM) as i64), grey, 1);
        // Steps are whole numbers once the axis spans a few of them.
        let text = if x1 - x0 >= 8.0 { format!("{fx:.0}") } else { label(fx) };
        let tx = (px - 20).min((W - text.len() * 12) as i64);
        c.text(&text, tx, (H - BOTTOM + 8) as i64, black);
    }
    c.line((LEFT as i64, (H - BOTTOM) as i64), ((W - RIGHT) as i64, (H - BOTTOM) as i64), black, 2);
    c.line((LEFT as i64, TOP as i64), (LEFT as i64, (H - BOTTOM) as i64), black, 2);
    c.text(title, LEFT as i64, 12, black);
    c.text("STEP", (W / 2) as i64, (H - 20) as i64, black);
    for (k, (name, p)) in lines.iter().enumerate() {
        let col = COLORS[k % COLORS.len()];
        for w in p.windows(2) {
            c.line(to(w[0].0, w[0].1), to(w[1].0, w[1].1), col, 2);
        }
        if p.len() == 1 {
            let (x, y) = to(p[0].0, p[0].1);
            c.line((x - 2, y), (x + 2, y), col, 3);
        }
        // Legend: a colour bar and the line's name.
        let shown: String = name.chars().rev().take(14).collect::<Vec<_>>().into_iter().rev().collect();
        let lx = (W - RIGHT - 36 - shown.len() * 12) as i64;
        let ly = TOP as i64 + 10 + k as i64 * 18;
        c.line((lx, ly + 6), (lx + 26, ly + 6), col, 3);
        c.text(&shown, lx + 32, ly, black);
    }
    c.png(path)
}

/// Renders every curve of `dir` into `out` (`loss.png`, `throughput.png`); returns the files
/// written and a description of the lines.
pub fn plot_run(dir: &Path, out: &Path) -> Result<Vec<(PathBuf, String)>, String> {
    let curves = collect(dir)?;
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut written = Vec::new();
    for (name, lines) in &curves {
        let (file, title) = match name.as_str() {
            "loss" => ("loss.png", "LOSS"),
            _ => ("throughput.png", "SAMPLES/S"),
        };
        let path = out.join(file);
        render(title, lines, &path)?;
        let desc =
            lines.iter().enumerate().map(|(k, (n, p))| format!("line {} = {n} ({} points)", k + 1, p.len())).collect::<Vec<_>>().join(", ");
        written.push((path, desc));
    }
    Ok(written)
}
