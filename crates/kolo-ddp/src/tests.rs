use super::*;

#[test]
fn plan_reverses_and_caps() {
    let p = bucket_plan(&[10, 20, 30, 40], 60, 60);
    assert_eq!(p, vec![Bucket { params: vec![3], numel: 40 }, Bucket { params: vec![2, 1, 0], numel: 60 }]);
    // A parameter above the cap gets a bucket of its own.
    let p = bucket_plan(&[5, 100, 5], 10, 10);
    assert_eq!(p.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![2], vec![1], vec![0]]);
    // Everything fits: one bucket.
    assert_eq!(bucket_plan(&[1, 2, 3], 1000, 1000).len(), 1);
    assert!(bucket_plan(&[], 10, 10).is_empty());
    // Every parameter exactly once.
    let p = bucket_plan(&[3, 1, 4, 1, 5, 9, 2, 6], 7, 7);
    let mut all: Vec<usize> = p.iter().flat_map(|b| b.params.clone()).collect();
    all.sort();
    assert_eq!(all, (0..8).collect::<Vec<_>>());
    assert!(p.iter().all(|b| b.numel <= 9));
    // A small first bucket, then large ones.
    let p = bucket_plan(&[4, 4, 4, 4, 4], 4, 100);
    assert_eq!(p.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![4], vec![3, 2, 1, 0]]);
}
