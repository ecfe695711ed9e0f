//! Host-side arithmetic for the GPU kernels' launches: the token
//! embedding's gradient groups the tokens by table row (`cube::embedding`).
//! Plain Rust, tested on every build.

/// The stable counting sort of `ids` (each in `0..rows`): `row_start`
/// (`rows + 1` offsets) and `order` (positions), so that row `r`'s tokens
/// are `order[row_start[r]..row_start[r + 1]]`, in order of position.
/// `None` where an id is outside the table.
pub(crate) fn group_by_row(ids: &[i64], rows: usize) -> Option<(Vec<i32>, Vec<i32>)> {
    let mut row_start = vec![0i32; rows + 1];
    for &id in ids {
        let row = usize::try_from(id).ok().filter(|&r| r < rows)?;
        row_start[row + 1] += 1;
    }
    for r in 0..rows {
        row_start[r + 1] += row_start[r];
    }
    let mut next: Vec<i32> = row_start[..rows].to_vec();
    let mut order = vec![0i32; ids.len()];
    for (position, &id) in ids.iter().enumerate() {
        let slot = &mut next[id as usize];
        order[*slot as usize] = position as i32;
        *slot += 1;
    }
    Some((row_start, order))
}

#[cfg(test)]
mod tests {
    use super::group_by_row;

    #[test]
    fn tokens_are_grouped_by_row_in_order_of_position() {
        let (start, order) = group_by_row(&[3, 0, 3, 1, 0, 3], 5).expect("ids in the table");
        assert_eq!(start, [0, 2, 3, 3, 6, 6]);
        assert_eq!(order, [1, 4, 3, 0, 2, 5]);
        assert!(group_by_row(&[5], 5).is_none());
        assert!(group_by_row(&[-1], 5).is_none());
        assert_eq!(group_by_row(&[], 2), Some((vec![0, 0, 0], vec![])));
    }
}
