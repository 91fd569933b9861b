//! PowerSGD (Vogels et al. 2019): a gradient matrix M (n x m) is sent as two thin factors,
//! P = M Q (n x r) and Q' = Mᵀ P̂ (m x r) with P̂ the orthonormalised P; the approximation is
//! P̂ Q'ᵀ. Across ranks the factors are all-reduced (averaged) between the two halves, Q is
//! warm-started from the previous step, and the error is fed back. The pieces here are the
//! per-rank linear algebra; the exchange is the strategy's.

/// `p (n x r) = m (n x cols) · q (cols x r)`, row-major.
pub fn matmul(m: &[f32], rows: usize, cols: usize, q: &[f32], r: usize, p: &mut [f32]) {
    assert_eq!(m.len(), rows * cols);
    assert_eq!(q.len(), cols * r);
    assert_eq!(p.len(), rows * r);
    p.iter_mut().for_each(|v| *v = 0.0);
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        let out = &mut p[i * r..(i + 1) * r];
        for (k, mk) in row.iter().enumerate() {
            let qk = &q[k * r..(k + 1) * r];
            out.iter_mut().zip(qk).for_each(|(o, q)| *o += mk * q);
        }
    }
}

/// `q (cols x r) = mᵀ (cols x rows) · p (rows x r)`.
pub fn matmul_t(m: &[f32], rows: usize, cols: usize, p: &[f32], r: usize, q: &mut [f32]) {
    assert_eq!(m.len(), rows * cols);
    assert_eq!(p.len(), rows * r);
    assert_eq!(q.len(), cols * r);
    q.iter_mut().for_each(|v| *v = 0.0);
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        let pi = &p[i * r..(i + 1) * r];
        for (k, mk) in row.iter().enumerate() {
            q[k * r..(k + 1) * r].iter_mut().zip(pi).for_each(|(o, p)| *o += mk * p);
        }
    }
}

/// Orthonormalises the r columns of `p` (rows x r, row-major) in place: Gram-Schmidt in f64,
/// each projection done twice ("twice is enough" for stability). A column that is (nearly) in
/// the span of the earlier ones becomes zero rather than normalised rounding noise, which
/// would point anywhere and add a spurious component when the matrix has rank below r.
pub fn orthonormalize(p: &mut [f32], rows: usize, r: usize) {
    let mut col = vec![0f64; rows];
    let mut done: Vec<Vec<f64>> = Vec::with_capacity(r);
    for j in 0..r {
        col.iter_mut().enumerate().for_each(|(i, c)| *c = f64::from(p[i * r + j]));
        let before = col.iter().map(|x| x * x).sum::<f64>().sqrt();
        for _ in 0..2 {
            for q in &done {
                let dot: f64 = col.iter().zip(q).map(|(a, b)| a * b).sum();
                col.iter_mut().zip(q).for_each(|(c, q)| *c -= dot * q);
            }
        }
        let norm = col.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > 1e-6 * before && norm > 1e-30 {
            col.iter_mut().for_each(|c| *c /= norm);
        } else {
            col.iter_mut().for_each(|c| *c = 0.0);
        }
        for i in 0..rows {
            p[i * r + j] = col[i] as f32;
        }
        done.push(col.clone());
    }
}

/// `out (rows x cols) = p (rows x r) · qᵀ (r x cols)`.
pub fn reconstruct(p: &[f32], rows: usize, q: &[f32], cols: usize, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), rows * cols);
    for i in 0..rows {
        let pi = &p[i * r..(i + 1) * r];
        for k in 0..cols {
            let qk = &q[k * r..(k + 1) * r];
            out[i * cols + k] = pi.iter().zip(qk).map(|(a, b)| a * b).sum();
        }
    }
}

/// Whether a `rows x cols` matrix is worth compressing at rank r (the factors must be smaller
/// than the matrix; torch's hook leaves such tensors uncompressed too).
pub fn worth_it(rows: usize, cols: usize, r: usize) -> bool {
    rows > 1 && cols > 1 && (rows + cols) * r < rows * cols
}

/// One rank's compression of `m` without communication (a world of one): P = M Q, orthonormalise,
/// Q = Mᵀ P, M̂ = P Qᵀ. `q` is the warm start and is updated.
pub fn compress_local(m: &[f32], rows: usize, cols: usize, r: usize, q: &mut [f32], out: &mut [f32]) {
    let mut p = vec![0f32; rows * r];
    matmul(m, rows, cols, q, r, &mut p);
    orthonormalize(&mut p, rows, r);
    matmul_t(m, rows, cols, &p, r, q);
    reconstruct(&p, rows, q, cols, r, out);
}
