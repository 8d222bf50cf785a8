"""The Llama of ``models.networks.llama`` written in plain JAX, the baseline that
benchmarks/accelerator.py measures shardops against: RMSNorm, rotate-half RoPE, grouped-query
attention (by einsum, or by JAX's Pallas TPU kernels: ``ATTENTIONS``), SwiGLU, the blocks under
one ``lax.scan``, bfloat16 products accumulated in float32 (``plain_logits``), and its train
step with optax (``plain_step``). tests/test_benchmark.py checks its logits against
``Llama.reference_logits`` and the TPU kernels against einsum attention.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

SPLASH_BLOCK = 512


def _dot(x, w, spec="...d,df->...f"):
    """``einsum(spec, x, w)`` of bfloat16 operands accumulated in float32."""
    return jnp.einsum(spec, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)  # fmt: skip


def _rms(x, scale, eps):
    """RMSNorm in float32, rounded once to bfloat16."""
    x = x.astype(jnp.float32)
    y = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale
    return y.astype(jnp.bfloat16)


def _rope(t, theta):
    """Hugging Face's rotate-half RoPE on ``t[B, S, n, hd]`` (float32)."""
    s, hd = t.shape[1], t.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2) / hd))  # (hd/2,) float64 at trace time
    angles = np.arange(s)[:, None] * inv_freq[None]  # (S, hd/2)
    cos = jnp.asarray(np.concatenate([np.cos(angles)] * 2, -1), jnp.float32)[:, None]  # (S, 1, hd)
    sin = jnp.asarray(np.concatenate([np.sin(angles)] * 2, -1), jnp.float32)[:, None]
    rotated = jnp.concatenate([-t[..., hd // 2 :], t[..., : hd // 2]], -1)
    return t * cos + rotated * sin


def einsum_attention(q, k, v):
    """Causal GQA ``q[B, S, H, hd]``, ``k, v[B, S, n, hd]`` (bf16) → ``o[B, S, H, hd]`` (bf16):
    scores and softmax in float32, the query heads grouped over their KV head."""
    b, s, h, hd = q.shape
    n = k.shape[2]
    q = q.reshape(b, s, n, h // n, hd)  # (B, S, n, G, hd)
    scores = jnp.einsum("bqngd,bknd->bngqk", q, k,
                        preferred_element_type=jnp.float32) / math.sqrt(hd)  # fmt: skip
    mask = np.tril(np.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)  # (B, n, G, S, S)
    o = jnp.einsum("bngqk,bknd->bqngd", weights.astype(jnp.bfloat16), v,
                   preferred_element_type=jnp.float32)  # fmt: skip
    return o.reshape(b, s, h, hd).astype(jnp.bfloat16)


def flash_attention(q, k, v):
    """JAX's Pallas TPU ``flash_attention`` (K and V repeated to every query head)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    s, h, hd = q.shape[1:]
    group = h // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # (B, S, H, hd)
    blk = min(SPLASH_BLOCK, s)
    sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                          block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk,
                          block_q_dkv=blk, block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)  # fmt: skip
    heads_first = [a.transpose(0, 2, 1, 3) for a in (q, k, v)]  # (B, H, S, hd)
    o = fa.flash_attention(*heads_first, causal=True, sm_scale=1 / math.sqrt(hd),
                           block_sizes=sizes)  # fmt: skip
    return o.transpose(0, 2, 1, 3)  # (B, S, H, hd)


def splash_attention(q, k, v, *, interpret: bool = False):
    """JAX's Pallas TPU splash attention: the MQA kernel on each KV head and its group of
    query heads (vmapped over batch and KV heads), causal, blocks of ``SPLASH_BLOCK``."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, s, h, hd = q.shape
    n = k.shape[2]
    group = h // n
    blk = min(SPLASH_BLOCK, s)
    sizes = sa.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                          block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk,
                          block_kv_dq=blk)  # fmt: skip
    mask = sa.MultiHeadMask([sa.CausalMask((s, s))] * group)
    kernel = sa.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    q = (q / math.sqrt(hd)).astype(q.dtype)  # the kernel does not scale
    q = q.reshape(b, s, n, group, hd).transpose(0, 2, 3, 1, 4)  # (B, n, G, S, hd)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, n, S, hd)
    o = jax.vmap(jax.vmap(kernel))(q, k, v)  # (B, n, G, S, hd)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s, h, hd)


ATTENTIONS = {"einsum": einsum_attention, "flash": flash_attention, "splash": splash_attention}


def plain_logits(model, params, ids, attend=einsum_attention, remat: str | None = None):
    """The Llama of ``models.networks.llama`` in plain JAX under mixed bfloat16: float32
    ``logits[B, S, V]`` of ``ids[B, S]``; ``remat`` (a key of ``PLAIN_REMAT``) checkpoints
    each block."""
    b, s = ids.shape
    h, n, hd, eps = model.num_heads, model.num_kv_heads, model.head_dim, model.norm_eps
    x = params["embed"]["table"][ids].astype(jnp.bfloat16)  # (B, S, D)

    def block(x, p):
        y = _rms(x, p["attn_norm"]["scale"], eps)
        a = p["attn"]
        q = _rope(_dot(y, a["wq"]).reshape(b, s, h, hd), model.rope_theta)  # (B, S, H, hd) f32
        k = _rope(_dot(y, a["wk"]).reshape(b, s, n, hd), model.rope_theta)  # (B, S, n, hd)
        v = _dot(y, a["wv"]).reshape(b, s, n, hd)
        o = attend(*(t.astype(jnp.bfloat16) for t in (q, k, v)))  # (B, S, H, hd)
        x = x + _dot(o.reshape(b, s, h * hd), a["wo"]).astype(jnp.bfloat16)
        y = _rms(x, p["mlp_norm"]["scale"], eps)
        m = p["mlp"]
        gated = jax.nn.silu(_dot(y, m["gate"]["w"])) * _dot(y, m["up"]["w"])  # (B, S, F) f32
        return x + _dot(gated.astype(jnp.bfloat16), m["down"]["w"]).astype(jnp.bfloat16), None

    if remat is not None:
        block = jax.checkpoint(block, policy=PLAIN_REMAT[remat])
    x, _ = lax.scan(block, x, params["blocks"])
    x = _rms(x, params["norm"]["scale"], eps)
    w = params["embed"]["table"].T if model.tie_embeddings else params["head"]["w"]
    return _dot(x, w)  # (B, S, V) float32


# build's remat policies and the jax.checkpoint policy each means for the plain programs
PLAIN_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def plain_step(model, optimizer, attend, remat):
    """``(state, ids, labels) → (state, loss)``: mean token cross-entropy, Adam."""

    def loss_fn(params, ids, labels):
        logits = plain_logits(model, params, ids, attend, remat)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    def step(state, ids, labels):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step
