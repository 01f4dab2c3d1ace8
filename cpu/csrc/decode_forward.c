/* The engine's whole model forward over one step's tokens on the CPU (fp32) in one call: the CPU's counterpart of
 * a CUDA graph (cpu/forward.py).
 *
 * A small model's decode step is a few dozen ops of a few microseconds of arithmetic each; called one by one from
 * Python each costs about as much in dispatch, allocation and argument checks as in work (the tiny model's step
 * at 256 rows: 3.1-3.4 ms of forward op by op, 2.2-2.5 ms here). Here every op of every layer runs from C, in the
 * order the engine's fused model runs them (engine/fused.py FusedTransformer.forward), with the very same functions:
 *
 *   embed -> for each layer: norm (+ residual add) -> q, k, v projections -> q / k head norms -> rotary (in place)
 *   -> K / V written to their pool slots -> paged attention -> o projection -> norm (+ residual add) -> gate, up
 *   -> silu(gate) * up -> down projection; then the final norm (+ residual add).
 *
 * The element-wise ops and the attention are this directory's kernels, compiled into this object (the #includes
 * below), and the projections are the BLAS sgemm that torch's F.linear calls (its address is passed in: torch's
 * own MKL), on rows padded to a multiple of 8 with zeros as cpu/linear.py `padded_linear` does: so a row's
 * result is bit for bit the one the op-by-op forward gives on the same batch (tests/test_cpu_forward.py).
 *
 * Layout: weights as the nn.Linear layers hold them ([out, in], contiguous), norms [dim], cos / sin [T, D], the
 * caches as in paged_attention.c. Scratch is allocated per call (malloc; ~1.3 MB at 256 rows of the tiny model). */
#include "paged_attention.c"
#include "sample.c"
#include "train_ops.c"


typedef struct {
    const float *input_norm, *q_proj, *k_proj, *v_proj, *q_norm, *k_norm, *o_proj, *post_norm, *gate, *up, *down;
    float *k_cache, *v_cache;   /* [num_blocks, block_size, Hkv, D] */
} layer_ptrs;

typedef struct {
    sgemm_fn sgemm;
    const layer_ptrs *layers;
    const float *embed, *final_norm;   /* [vocab, hidden], [hidden] */
    int64_t num_layers, vocab, hidden, heads, kv_heads, head_dim, inter, block_size, num_blocks;
    float eps, scale;
} model_ptrs;

/* y [rows, n] = x [rows, k] @ w[n, k]^T (row-major), i.e. F.linear(x, w). */
static void linear(const model_ptrs *m, const float *x, const float *w, float *y, int64_t rows, int64_t n,
                   int64_t k) {
    const int N = (int)n, M = (int)rows, K = (int)k;
    const float one = 1.0f, zero = 0.0f;
    m->sgemm("T", "N", &N, &M, &K, &one, w, &K, x, &K, &zero, y, &N);
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 when a token id, a pool slot, a row's sequence or a
 * block it would read is out of range (checked before anything is written). */
int decode_forward_f32(const model_ptrs *m, const int64_t *ids, const float *cs, const float *sn,
                       const int64_t *slots, const int32_t *block_tables, int64_t bt_stride, const int32_t *row_seq,
                       const int32_t *row_len, int64_t num_seqs, int64_t T, float *out, int nt) {
    const int64_t H = m->hidden, D = m->head_dim, Q = m->heads * D, KV = m->kv_heads * D, I = m->inter;
    const int64_t pool = m->num_blocks * m->block_size, Tp = (T + 7) / 8 * 8;
    if (T <= 0) return 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t b = row_seq[t], n = row_len[t];
        if (ids[t] < 0 || ids[t] >= m->vocab || slots[t] < 0 || slots[t] >= pool) return -2;
        if (b < 0 || b >= num_seqs || n > bt_stride * m->block_size) return -2;
        for (int64_t i = 0; i < (n + m->block_size - 1) / m->block_size; i++) {
            const int32_t blk = block_tables[b * bt_stride + i];
            if (blk < 0 || blk >= m->num_blocks) return -2;
        }
    }
    /* rows padded to Tp for the projections (see below) */
    const int64_t widths[] = {H, H, H, Q, KV, KV, Q, KV, Q, H, I, I, I};
    size_t total = 0;
    for (int i = 0; i < 13; i++) total += (size_t)(Tp * widths[i]);
    float *buf = (float *)malloc(total * sizeof(float));
    if (buf == NULL) return -1;
    float *x = buf, *res = x + Tp * H, *h = res + Tp * H, *q = h + Tp * H, *k = q + Tp * Q, *v = k + Tp * KV;
    float *qn = v + Tp * KV, *kn = qn + Tp * Q, *att = kn + Tp * KV, *o = att + Tp * Q, *g = o + Tp * H;
    float *u = g + Tp * I, *a = u + Tp * I;
    for (int64_t t = 0; t < T; t++) memcpy(x + t * H, m->embed + ids[t] * H, (size_t)H * sizeof(float));
    /* The element-wise ops and the attention touch rows [0, T) only; the projections read all Tp rows of their
     * inputs (h, att, a), whose pad rows are zero, as padded_linear's */
    const int64_t pad = (Tp - T) * (int64_t)sizeof(float);
    if (pad) {
        memset(h + T * H, 0, (size_t)(pad * H));
        memset(att + T * Q, 0, (size_t)(pad * Q));
        memset(a + T * I, 0, (size_t)(pad * I));
    }
    int rc = 0;
    for (int64_t l = 0; l < m->num_layers && rc == 0; l++) {
        const layer_ptrs *w = m->layers + l;
        if (l == 0) {   /* h = norm(x), residual = x */
            rmsnorm_infer(x, NULL, w->input_norm, h, NULL, T, H, m->eps, nt);
            memcpy(res, x, (size_t)(T * H) * sizeof(float));
        } else {        /* residual = x + residual, h = norm(residual) */
            rmsnorm_infer(x, res, w->input_norm, h, o, T, H, m->eps, nt);
            memcpy(res, o, (size_t)(T * H) * sizeof(float));
        }
        linear(m, h, w->q_proj, q, Tp, Q, H);
        linear(m, h, w->k_proj, k, Tp, KV, H);
        linear(m, h, w->v_proj, v, Tp, KV, H);
        if (w->q_norm != NULL) {   /* Qwen3's per-head norms */
            rmsnorm_infer(q, NULL, w->q_norm, qn, NULL, T * m->heads, D, m->eps, nt);
            rmsnorm_infer(k, NULL, w->k_norm, kn, NULL, T * m->kv_heads, D, m->eps, nt);
        } else {
            memcpy(qn, q, (size_t)(T * Q) * sizeof(float));
            memcpy(kn, k, (size_t)(T * KV) * sizeof(float));
        }
        rope_inplace(qn, cs, sn, T, m->heads, D, nt);
        rope_inplace(kn, cs, sn, T, m->kv_heads, D, nt);
        for (int64_t t = 0; t < T; t++) {
            memcpy(w->k_cache + slots[t] * KV, kn + t * KV, (size_t)KV * sizeof(float));
            memcpy(w->v_cache + slots[t] * KV, v + t * KV, (size_t)KV * sizeof(float));
        }
        rc = paged_attention_f32(qn, w->k_cache, w->v_cache, block_tables, bt_stride, row_seq, row_len, att, T,
                                 m->heads, m->kv_heads, D, m->block_size, m->num_blocks, num_seqs, m->scale, nt);
        if (rc != 0) break;
        linear(m, att, w->o_proj, o, Tp, H, Q);
        rmsnorm_infer(o, res, w->post_norm, h, x, T, H, m->eps, nt);   /* x = o + residual, h = norm(x) */
        memcpy(res, x, (size_t)(T * H) * sizeof(float));
        linear(m, h, w->gate, g, Tp, I, H);
        linear(m, h, w->up, u, Tp, I, H);
        swiglu_fwd(g, u, a, T * I, nt);
        linear(m, a, w->down, x, Tp, H, I);
    }
    if (rc == 0) rmsnorm_infer(x, res, m->final_norm, out, o, T, H, m->eps, nt);
    free(buf);
    return rc;
}

/* Several decode steps in one call (cpu/forward.py `decode_steps`; the CPU's counterpart of vLLM's
 * multi-step scheduling): each step is decode_forward_f32 over the rows still running, the LM head (on rows padded
 * to 8, as padded_linear computes it) and sample.c's temperature sampling, the sampled tokens fed back as the next
 * step's ids. What a step takes that depends on the step is prepared by the caller for all of them: rotary cos /
 * sin [steps, T, D], pool slots [steps, T], uniforms u [steps, T]; row t's context at step j is row_len0[t] + j.
 *
 * A row stops at the first token in its `stops` row (S ids, -1 padded) or at a NaN logprob (non-finite logits), and
 * the next step runs the rows left, in their order, as the engine's next step would (a finished sequence leaves
 * the batch): so every step computes the very batch, hence the very bits, one engine step would. The call returns
 * early once every row has stopped. counts[t]: tokens sampled for row t, the stopping one included; tokens,
 * logprobs [steps, T] (past a row's count: not written). Returns decode_forward_f32's codes (-1 scratch, -2 a bad
 * index). */
int decode_steps_f32(const model_ptrs *m, const float *lm_head, int64_t steps, int64_t T, const int64_t *ids0,
                     const float *cs, const float *sn, const int64_t *slots, const int32_t *block_tables,
                     int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len0, int64_t num_seqs,
                     const float *temps, const float *u, const int64_t *stops, int64_t S, int64_t *tokens,
                     float *logprobs, int32_t *counts, int nt) {
    const int64_t H = m->hidden, D = m->head_dim, V = m->vocab, Tp = (T + 7) / 8 * 8;
    for (int64_t t = 0; t < T; t++) counts[t] = 0;
    if (T <= 0) return 0;
    /* the running rows' inputs, compacted at the front: row i of the step is the caller's row idx[i]; one
     * allocation carved up (int64 arrays first, then the 4-byte ones) */
    const size_t bytes = (size_t)T * (5 * sizeof(int64_t) + 2 * sizeof(int32_t) + (2 * D + 3) * sizeof(float))
                         + (size_t)(Tp * (H + V)) * sizeof(float);
    int64_t *idx = (int64_t *)malloc(bytes);
    if (idx == NULL) return -1;
    int rc = 0;
    int64_t *ids = idx + T, *w_ids = ids + T, *w_slots = w_ids + T, *w_tok = w_slots + T;
    int32_t *w_seq = (int32_t *)(w_tok + T), *w_len = w_seq + T;
    float *w_cs = (float *)(w_len + T), *w_sn = w_cs + T * D, *w_temps = w_sn + T * D, *w_u = w_temps + T;
    float *w_lp = w_u + T, *hid = w_lp + T, *logits = hid + Tp * H;   /* hid: rows past the step's are zeroed */
    int64_t n = T;
    for (int64_t i = 0; i < n; i++) idx[i] = i, ids[i] = ids0[i];
    for (int64_t j = 0; j < steps && n > 0; j++) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = idx[i];
            w_ids[i] = ids[r], w_slots[i] = slots[j * T + r], w_seq[i] = row_seq[r];
            w_len[i] = row_len0[r] + (int32_t)j, w_temps[i] = temps[r], w_u[i] = u[j * T + r];
            memcpy(w_cs + i * D, cs + (j * T + r) * D, (size_t)D * sizeof(float));
            memcpy(w_sn + i * D, sn + (j * T + r) * D, (size_t)D * sizeof(float));
        }
        const int64_t np = (n + 7) / 8 * 8;
        rc = decode_forward_f32(m, w_ids, w_cs, w_sn, w_slots, block_tables, bt_stride, w_seq, w_len, num_seqs, n,
                                hid, nt);
        if (rc != 0) break;
        memset(hid + n * H, 0, (size_t)((np - n) * H) * sizeof(float));   /* pad rows zero, as padded_linear's */
        linear(m, hid, lm_head, logits, np, V, H);
        sample_f32(logits, n, V, V, w_temps, w_u, w_tok, w_lp, nt);
        int64_t kept = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = idx[i];
            const int bad = w_lp[i] != w_lp[i];
            tokens[j * T + r] = w_tok[i], logprobs[j * T + r] = w_lp[i], counts[r] = (int32_t)(j + 1);
            ids[r] = w_tok[i];
            int stop = bad;
            for (int64_t q = 0; q < S && !stop; q++) stop = stops[r * S + q] == w_tok[i];
            if (!stop) idx[kept++] = r;
        }
        n = kept;
    }
    free(idx);
    return rc;
}
