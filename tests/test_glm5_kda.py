"""KDA: the chunked prefill, pieces of a prompt and the per-position verify steps are one recurrence."""

import pytest
import torch

from glm5_checkpoints import single_thread  # noqa: F401

from qual.runtime.models.glm5.kda import KdaState, KdaWeights, kda_prefill, kda_state_at, kda_verify, kda_zero_state

F64 = torch.float64


def _weights(lower_bound=-5.0, K=4, H=3, D=8, hid=16, seed=0) -> KdaWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=1.0: torch.randn(*shape, generator=g, dtype=F64) * s  # noqa: E731
    return KdaWeights(qkv=r(3 * H * D, hid, s=hid**-0.5), conv=r(3 * H * D, K, s=K**-0.5), f_a=r(D, hid, s=hid**-0.5),
                      f_b=r(H * D, D, s=D**-0.5), dt_bias=r(H * D, s=0.5), a_log=r(H, s=0.5), b=r(H, hid, s=hid**-0.5),
                      g_a=r(D, hid, s=hid**-0.5), g_b=r(H * D, D, s=D**-0.5), o_norm=1 + r(D, s=0.1),
                      o_proj=r(hid, H * D, s=(H * D) ** -0.5), num_heads=H, head_dim=D, lower_bound=lower_bound, eps=1e-5)


def _x(R, T, seed=1, hid=16):
    return torch.randn(R, T, hid, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _close(a: KdaState, b: KdaState, tol=1e-12):
    assert a.conv.shape == b.conv.shape and torch.allclose(a.conv, b.conv, rtol=0, atol=tol)
    assert torch.allclose(a.recurrent, b.recurrent, rtol=0, atol=tol)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_prefill_equals_token_steps(lower_bound, chunk):
    w, x = _weights(lower_bound), _x(2, 37)
    s0 = kda_zero_state(w, 2, F64)
    out, state = kda_prefill(w, x, s0, chunk)
    steps_out, states = kda_verify(w, x, s0)
    assert (out - steps_out).abs().max() < 1e-12
    _close(state, kda_state_at(states, torch.tensor([36, 36])))
    assert state.recurrent.abs().max() > 0.1  # the state carries something


@pytest.mark.parametrize("K", [4, 1])
def test_prompt_pieces_equal_one_prefill(K):
    w, x = _weights(K=K), _x(1, 40)
    whole, state = kda_prefill(w, x, kda_zero_state(w, 1, F64), 16)
    outs, s, at = [], kda_zero_state(w, 1, F64), 0
    for n in (10, 1, 17, 12):  # piece boundaries fall inside and across 16-token chunks
        o, s = kda_prefill(w, x[:, at:at + n], s, 16)
        outs.append(o)
        at += n
    assert (torch.cat(outs, 1) - whole).abs().max() < 1e-12
    _close(s, state)


def test_verify_state_i_equals_running_i_plus_1_tokens():
    w = _weights(seed=2)
    prompt, drafts = _x(3, 9, seed=3), _x(3, 5, seed=4)
    _, s = kda_prefill(w, prompt, kda_zero_state(w, 3, F64))
    out, states = kda_verify(w, drafts, s)
    for i in range(5):
        o, direct = kda_prefill(w, drafts[:, : i + 1], s)
        _close(kda_state_at(states, torch.full((3,), i)), direct)
        assert (o[:, i] - out[:, i]).abs().max() < 1e-12
    picked = kda_state_at(states, torch.tensor([0, 4, 2]))
    for r, i in enumerate((0, 4, 2)):
        _, direct = kda_prefill(w, drafts[r:r + 1, : i + 1], KdaState(s.conv[r:r + 1], s.recurrent[r:r + 1]))
        _close(KdaState(picked.conv[r:r + 1], picked.recurrent[r:r + 1]), direct)


def test_batched_verify_equals_per_request():
    w = _weights(lower_bound=None, seed=5)
    prompts = [_x(1, n, seed=10 + n) for n in (3, 11, 6)]
    states = [kda_prefill(w, p, kda_zero_state(w, 1, F64))[1] for p in prompts]
    batch = KdaState(torch.cat([s.conv for s in states]), torch.cat([s.recurrent for s in states]))
    x = _x(3, 4, seed=6)
    out, per_pos = kda_verify(w, x, batch)
    for r, s in enumerate(states):
        o, p = kda_verify(w, x[r:r + 1], s)
        assert (o[0] - out[r]).abs().max() < 1e-13
        assert (p.recurrent[0] - per_pos.recurrent[r]).abs().max() < 1e-13
