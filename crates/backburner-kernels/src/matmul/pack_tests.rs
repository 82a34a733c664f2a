//! Packing: panel positions, row reads, byte counts, fused parts and the kept checkpoint bits.

use super::*;

#[test]
fn packing_puts_each_element_at_its_panel_position_and_rows_read_back() {
    let (n, k) = (37, 5);
    let w: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
    let m = PackedMatrix::from_f32(n, k, &w, WeightDtype::F32);
    assert_eq!(m.n_panels(), 4); // 37 rows → 3 panels → padded to 4
    let Storage::F32(d) = &m.data else { panic!() };
    let d = d.view::<f32>();
    assert_eq!(d.len(), 4 * k * PANEL);
    // element (r = 17, kk = 3): panel 1, l = 1
    assert_eq!(d[k * PANEL + 3 * PANEL + 1], (17 * k + 3) as f32);
    // padding rows are zero
    assert_eq!(d[2 * k * PANEL + 2 * PANEL + 10], 0.0);
    assert_eq!(m.to_f32_rows(), w);
    assert_eq!(m.bytes(), 4 * 4 * k * PANEL);
    assert_eq!(
        PackedMatrix::packed_bytes(n, k, WeightDtype::F32),
        Some(m.bytes())
    );
    let h = PackedMatrix::from_f32(200, 3, &vec![0.5; 600], WeightDtype::Bf16);
    assert_eq!(
        PackedMatrix::packed_bytes(200, 3, WeightDtype::Bf16),
        Some(h.bytes())
    );
    assert_eq!(
        PackedMatrix::packed_bytes(usize::MAX, 2, WeightDtype::F32),
        None
    );
}

#[test]
fn fused_parts_of_mixed_dtypes_are_kept_in_f32_exactly() {
    let k = 3;
    let a: Vec<u8> = [1.5f32, -2.0, 3.25]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let b: Vec<u8> = [0.5f32, 7.0, -1.0, 2.0, 4.0, 8.0]
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    let parts = [
        RowMajor {
            dtype: WeightDtype::F32,
            bytes: &a,
            rows: 1,
        },
        RowMajor {
            dtype: WeightDtype::Bf16,
            bytes: &b,
            rows: 2,
        },
    ];
    assert_eq!(WeightDtype::common(&parts), WeightDtype::F32);
    let m = PackedMatrix::pack(k, &parts, WeightDtype::common(&parts)).unwrap();
    assert_eq!((m.n(), m.k()), (3, 3));
    assert_eq!(
        m.to_f32_rows(),
        vec![1.5, -2.0, 3.25, 0.5, 7.0, -1.0, 2.0, 4.0, 8.0]
    );
    let bad = [RowMajor {
        dtype: WeightDtype::F32,
        bytes: &a[..8],
        rows: 1,
    }];
    assert_eq!(
        PackedMatrix::pack(k, &bad, WeightDtype::F32),
        Err(PackError::Length {
            part: 0,
            got: 8,
            rows: 1,
            k: 3,
            size: 4
        })
    );
}

#[test]
fn bf16_and_f16_storage_keep_the_checkpoint_bits() {
    let vals = [1.0f32, -0.333, 65504.0, 1e-7, 0.0, -0.0];
    for dtype in [WeightDtype::Bf16, WeightDtype::F16] {
        let m = PackedMatrix::from_f32(2, 3, &vals, dtype);
        let want: Vec<f32> = vals
            .iter()
            .map(|&v| match dtype {
                WeightDtype::Bf16 => bf16::from_f32(v).to_f32(),
                _ => f16::from_f32(v).to_f32(),
            })
            .collect();
        let got = m.to_f32_rows();
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.to_bits(), w.to_bits(), "{dtype}");
        }
        assert_eq!(m.bytes(), 2 * 4 * 3 * PANEL);
    }
}
