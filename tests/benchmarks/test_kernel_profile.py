"""benchmarks/kernel_profile.py: the profiled step's kernel time by kind and stage, checked against hand-counted
intervals, and its reading of a real torch.profiler run on the CPU (no CUDA kernels there: the ranges and the window
are what it can check)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import kernel_profile as kp


@pytest.mark.parametrize(
    "name,kind",
    [
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "matmul"),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", "attention"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("triton_red_fused__to_copy_add_mul_native_layer_norm_split_unsqueeze_1", "fused"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("Memset (Device)", "copy"),
        ("void cudnn::cnn::implicit_convolve_sgemm<float>", "convolution"),
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwc_tilesize128x128x64", "convolution"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ],
)
def test_kernel_kind(name, kind):
    assert kp.kernel_kind(name) == kind


def test_union_counts_overlap_once():
    # [0, 10) and [5, 12) overlap on [5, 10): union 12; [20, 21) is apart; [2, 3) lies inside the first
    assert kp.union_us([(0, 10), (5, 12), (20, 21), (2, 3)]) == 13
    assert kp.union_us([]) == 0


def test_summarize_by_kind_stage_and_busy():
    ranges = [
        kp.StageRange("generate", 0, 100, thread=1),
        kp.StageRange("score", 50, 130, thread=2),  # overlaps generate on another thread
        kp.StageRange("update_actor", 140, 200, thread=1),
    ]
    kernels = [
        kp.Kernel("nvjet_gemm_a", 5, 45, launch_us=2, launch_thread=1),  # generate, matmul 40 us
        kp.Kernel("flash_fwd", 45, 60, launch_us=40, launch_thread=1),  # generate, attention 15 us
        kp.Kernel("triton_poi_fused_gelu", 60, 70, launch_us=60, launch_thread=9),  # other thread: shortest range
        kp.Kernel("nvjet_gemm_b", 150, 190, launch_us=141, launch_thread=1),  # update, matmul 40 us
        kp.Kernel("Memcpy DtoH", 190, 195, launch_us=135, launch_thread=3),  # launched between stages: outside
        kp.Kernel("nvjet_gemm_next", 205, 240, launch_us=201, launch_thread=4),  # after the window: not counted
    ]
    summary = kp.summarize(kernels, ranges, window=(0, 200))
    assert summary["wall_s"] == pytest.approx(200e-6)
    assert summary["kernel_s"] == pytest.approx(110e-6)
    # busy: [5, 70) and [150, 195) = 65 + 45 us over 200 us
    assert summary["busy_s"] == pytest.approx(110e-6)
    assert summary["busy_fraction"] == pytest.approx(0.55)
    assert summary["kernel_s_by_kind"]["matmul"] == pytest.approx(80e-6)
    assert summary["kernel_s_by_kind"]["attention"] == pytest.approx(15e-6)
    assert summary["share_by_kind"]["fused"] == pytest.approx(10 / 110)
    stages = summary["stages"]
    # the triton kernel came from thread 9, inside both generate (0-100) and score (50-130): the shorter range wins
    assert stages["score"]["kernel_s"]["fused"] == pytest.approx(10e-6)
    assert stages["generate"]["kernel_s"]["matmul"] == pytest.approx(40e-6)
    assert stages["generate"]["busy_fraction"] == pytest.approx(55 / 100)
    assert stages["update_actor"]["wall_s"] == pytest.approx(60e-6)
    assert stages["outside"]["kernel_s"]["copy"] == pytest.approx(5e-6)
    assert stages["outside"]["wall_s"] is None
    assert [k["name"] for k in summary["top_kernels"]][:2] == ["nvjet_gemm_a", "nvjet_gemm_b"]
    assert "GPU busy" in kp.format_summary(summary)


def test_profile_rows_reads_ranges_and_window():
    """A real torch.profiler run on the CPU: the stage table wrapped by `stage_ranges` records a range per call, and
    the table is restored after."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def work(x):
        return (x @ x).sum()

    table = {"update_actor": (work, float)}
    with kp.stage_ranges(table), profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(kp.WINDOW):
            table["update_actor"][0](torch.ones(64, 64))
            table["update_actor"][0](torch.ones(64, 64))
    assert table["update_actor"][0] is work
    kernels, ranges, window = kp.profile_rows(prof)
    assert kernels == []  # no device on the CPU
    assert [r.stage for r in ranges] == ["update_actor", "update_actor"]
    assert window[0] <= ranges[0].start_us <= ranges[1].end_us <= window[1]
    summary = kp.summarize(kernels, ranges, window)
    assert summary["kernel_s"] == 0
    assert summary["stages"]["update_actor"]["wall_s"] == pytest.approx(
        sum(r.end_us - r.start_us for r in ranges) / 1e6
    )


def test_profile_rows_without_window_is_an_error():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    with pytest.raises(ValueError, match="profiled_step"):
        kp.profile_rows(prof)
