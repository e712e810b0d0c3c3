# ModelTC/LightLLM#469 (commit ff366f84f, "remove sliding windows of qwen2").
#
# LightLLM's Qwen2 port reused the Mistral triton kernels: Qwen2InferStateInfo read
# model.config["sliding_window"] and the Qwen2 layer infer passed it to the Mistral
# context_attention_fwd (prefill) and token_att_fwd / token_softmax_reducev_fwd (decode,
# with b_att_seq_len = min(b_seq_len, sliding_window) from init_att_window_info_fwd).
# Qwen1.5 / Qwen2 checkpoints ship a `sliding_window` value together with
# `use_sliding_window: false`, so every layer of the model ran windowed attention the
# checkpoint was never trained with, once a request grew past the window.
# The fix deletes Qwen2InferStateInfo and the windowed kernels: Qwen2 uses
# LlamaInferStateInfo and the Llama (full causal) attention kernels.
#
# Plain-torch stand-ins for the triton kernels, same arguments and packed layout
# (tokens of all requests concatenated, b_start_loc / b_seq_len, req_to_token_indexs).
import sys

import numpy as np
import torch

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# --------------------------------------------------------------------------------------
# kernels (torch stand-ins for the triton kernels, same signatures)
# --------------------------------------------------------------------------------------
def rotary_emb_fwd(q, k, cos, sin):
    # q: (T, H, D), k: (T, Hk, D), cos/sin: (T, D // 2)
    def rot(x):
        d = x.shape[-1] // 2
        x0, x1 = x[..., :d], x[..., d:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)

    q.copy_(rot(q))
    k.copy_(rot(k))


def init_att_window_info_fwd(batch_size, b_seq_len, b_att_seq_len, sliding_window):
    assert batch_size == b_seq_len.shape[0] == b_att_seq_len.shape[0]
    b_att_seq_len.copy_(torch.minimum(b_seq_len, torch.full_like(b_seq_len, sliding_window)))


def mistral_context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, sliding_window):
    # lightllm/models/mistral/triton_kernel/context_flashattention_nopad.py
    sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    kv_group_num = q.shape[1] // k.shape[1]
    for b in range(b_seq_len.shape[0]):
        start, n = int(b_start_loc[b]), int(b_seq_len[b])
        qb = q[start : start + n].transpose(0, 1)  # (H, n, D)
        kb = k[start : start + n].repeat_interleave(kv_group_num, dim=1).transpose(0, 1)
        vb = v[start : start + n].repeat_interleave(kv_group_num, dim=1).transpose(0, 1)
        qk = (qb @ kb.transpose(1, 2)) * sm_scale
        offs_m = torch.arange(n)[:, None]
        offs_n = torch.arange(n)[None, :]
        qk = torch.where(offs_m >= offs_n, qk, float("-inf"))
        qk = torch.where(offs_n > (offs_m - sliding_window), qk, float("-inf"))
        p = torch.softmax(qk, dim=-1)
        o[start : start + n] = (p @ vb).transpose(0, 1)


def llama_context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len):
    # lightllm/models/llama/triton_kernel/context_flashattention_nopad.py
    sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    kv_group_num = q.shape[1] // k.shape[1]
    for b in range(b_seq_len.shape[0]):
        start, n = int(b_start_loc[b]), int(b_seq_len[b])
        qb = q[start : start + n].transpose(0, 1)
        kb = k[start : start + n].repeat_interleave(kv_group_num, dim=1).transpose(0, 1)
        vb = v[start : start + n].repeat_interleave(kv_group_num, dim=1).transpose(0, 1)
        qk = (qb @ kb.transpose(1, 2)) * sm_scale
        offs_m = torch.arange(n)[:, None]
        offs_n = torch.arange(n)[None, :]
        qk = torch.where(offs_m >= offs_n, qk, float("-inf"))
        p = torch.softmax(qk, dim=-1)
        o[start : start + n] = (p @ vb).transpose(0, 1)


def mistral_token_att_fwd(q, k, att_out, Req_to_tokens, B_req_idx, B_Start_Loc, B_Seqlen,
                          B_Att_Start_Loc, B_Att_Seqlen, sliding_window):
    # lightllm/models/mistral/triton_kernel/token_attention_nopad_att1.py
    sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    kv_group_num = q.shape[1] // k.shape[1]
    for b in range(B_Seqlen.shape[0]):
        cur_batch_seq_len = int(B_Seqlen[b])
        cur_batch_in_all_start_index = int(B_Att_Start_Loc[b])  # use window index
        cur_att_seq_len = int(B_Att_Seqlen[b])
        cur_batch_start_index = max(cur_batch_seq_len - sliding_window, 0)
        offs_n_new = cur_batch_start_index + torch.arange(cur_att_seq_len)
        k_loc = Req_to_tokens[int(B_req_idx[b]), offs_n_new]
        kb = k[k_loc].repeat_interleave(kv_group_num, dim=1)  # (n, H, D)
        att_value = (q[b][None] * kb).sum(-1) * sm_scale  # (n, H)
        att_out[:, cur_batch_in_all_start_index : cur_batch_in_all_start_index + cur_att_seq_len] = att_value.T


def mistral_token_softmax_reducev_fwd(logics, v, o, req_to_tokens, b_req_idx, b_start_loc, b_seq_len,
                                      b_att_start_loc, b_att_seq_len, other_kv_index, sliding_window):
    # lightllm/models/mistral/triton_kernel/token_attention_softmax_and_reducev.py
    kv_group_num = o.shape[1] // v.shape[1]
    for b in range(b_seq_len.shape[0]):
        cur_batch_seq_len = int(b_seq_len[b])
        start = int(b_att_start_loc[b])
        n = int(b_att_seq_len[b])
        cur_batch_start_index = max(cur_batch_seq_len - sliding_window, 0)
        offs_n_new = cur_batch_start_index + torch.arange(n)
        v_loc = req_to_tokens[int(b_req_idx[b]), offs_n_new]
        vb = v[v_loc].repeat_interleave(kv_group_num, dim=1)  # (n, H, D)
        p = torch.softmax(logics[:, start : start + n], dim=-1)  # (H, n)
        o[b] = torch.einsum("hn,nhd->hd", p, vb)


def llama_token_att_fwd(q, k, att_out, Req_to_tokens, B_req_idx, B_Start_Loc, B_Seqlen, max_len_in_batch):
    # lightllm/models/llama/triton_kernel/token_attention_nopad_att1.py
    sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    kv_group_num = q.shape[1] // k.shape[1]
    for b in range(B_Seqlen.shape[0]):
        n = int(B_Seqlen[b])
        start = int(B_Start_Loc[b])
        k_loc = Req_to_tokens[int(B_req_idx[b]), :n]
        kb = k[k_loc].repeat_interleave(kv_group_num, dim=1)
        att_out[:, start : start + n] = ((q[b][None] * kb).sum(-1) * sm_scale).T


def llama_token_softmax_reducev_fwd(logics, v, o, req_to_tokens, b_req_idx, b_start_loc, b_seq_len):
    kv_group_num = o.shape[1] // v.shape[1]
    for b in range(b_seq_len.shape[0]):
        n = int(b_seq_len[b])
        start = int(b_start_loc[b])
        v_loc = req_to_tokens[int(b_req_idx[b]), :n]
        vb = v[v_loc].repeat_interleave(kv_group_num, dim=1)
        p = torch.softmax(logics[:, start : start + n], dim=-1)
        o[b] = torch.einsum("hn,nhd->hd", p, vb)


def destindex_copy_kv(kv, dest_loc, out):
    out[dest_loc] = kv


# --------------------------------------------------------------------------------------
# memory / request managers
# --------------------------------------------------------------------------------------
class MemoryManager:
    def __init__(self, size, head_num, head_dim, layer_num):
        self.kv_buffer = [torch.zeros(size, 2 * head_num, head_dim) for _ in range(layer_num)]
        self.next = 0

    def alloc(self, need_size):
        idx = torch.arange(self.next, self.next + need_size)
        self.next += need_size
        return idx


class ReqManager:
    def __init__(self, max_request_num, max_sequence_length):
        self.req_to_token_indexs = torch.zeros(max_request_num, max_sequence_length, dtype=torch.long)


# --------------------------------------------------------------------------------------
# infer states
# --------------------------------------------------------------------------------------
class LlamaInferStateInfo:
    def __init__(self):
        self.batch_size = None
        self.total_token_num = None
        self.b_req_idx = None
        self.b_start_loc = None
        self.b_seq_len = None
        self.max_len_in_batch = None
        self.is_prefill = None
        self.mem_index = None
        self.mem_manager = None
        self.req_manager = None
        self.position_cos = None
        self.position_sin = None
        self.other_kv_index = None

    def init_some_extra_state(self, model, input_ids):
        if self.is_prefill:
            b_seq_len_numpy = self.b_seq_len.cpu().numpy()
            position_ids = torch.from_numpy(
                np.concatenate([np.arange(0, b_seq_len_numpy[i]) for i in range(len(b_seq_len_numpy))], axis=0)
            )
            self.position_cos = torch.index_select(model._cos_cached, 0, position_ids).view(position_ids.shape[0], -1)
            self.position_sin = torch.index_select(model._sin_cached, 0, position_ids).view(position_ids.shape[0], -1)
            position_ids = None
        else:
            position_ids = self.b_seq_len - 1
            self.position_cos = torch.index_select(model._cos_cached, 0, position_ids).view(self.b_seq_len.shape[0], -1)
            self.position_sin = torch.index_select(model._sin_cached, 0, position_ids).view(self.b_seq_len.shape[0], -1)
            self.other_kv_index = self.req_manager.req_to_token_indexs[self.b_req_idx[0], 0].item()
        return


class Qwen2InferStateInfo(LlamaInferStateInfo):
    def __init__(self):
        super().__init__()
        self.sliding_window = None
        self.b_att_seq_len = None
        self.b_att_start_loc = None
        self.total_cache_num = None

    def init_some_extra_state(self, model, input_ids):
        self.sliding_window = model.config["sliding_window"]
        super().init_some_extra_state(model, input_ids)
        if not self.is_prefill:
            self.b_att_seq_len = torch.zeros_like(self.b_seq_len)
            init_att_window_info_fwd(self.batch_size, self.b_seq_len, self.b_att_seq_len, self.sliding_window)
            self.b_att_start_loc = torch.cumsum(self.b_att_seq_len, 0) - self.b_att_seq_len
            self.total_cache_num = torch.sum(self.b_att_seq_len).item()
        return


# --------------------------------------------------------------------------------------
# weights and layer infer
# --------------------------------------------------------------------------------------
class Qwen2TransformerLayerWeight:
    def __init__(self, cfg):
        h = cfg["hidden_size"]
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = h // nh
        g = lambda *s: torch.randn(*s) * 0.2
        self.att_norm_weight_ = torch.ones(h)
        self.q_weight_ = g(h, nh * d)
        self.q_bias_ = g(nh * d)
        self.kv_weight_ = g(h, 2 * nkv * d)
        self.kv_bias_ = g(2 * nkv * d)
        self.o_weight_ = g(nh * d, h)
        self.ffn_norm_weight_ = torch.ones(h)
        self.gate_up_proj = g(h, 2 * cfg["intermediate_size"])
        self.down_proj = g(cfg["intermediate_size"], h)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class LlamaTransformerLayerInfer:
    def __init__(self, layer_num, network_config):
        self.layer_num_ = layer_num
        self.network_config_ = network_config
        self.eps_ = network_config["rms_norm_eps"]
        self.embed_dim_ = network_config["hidden_size"]
        self.tp_q_head_num_ = network_config["num_attention_heads"]
        self.tp_k_head_num_ = network_config["num_key_value_heads"]
        self.tp_v_head_num_ = network_config["num_key_value_heads"]
        self.head_dim_ = self.embed_dim_ // self.tp_q_head_num_

    def _context_attention_kernel(self, q, kv, infer_state, layer_weight, out=None):
        o_tensor = torch.empty_like(q) if out is None else out
        llama_context_attention_fwd(
            q.view(-1, self.tp_q_head_num_, self.head_dim_),
            kv[:, 0 : self.tp_k_head_num_, :],
            kv[:, self.tp_k_head_num_ : self.tp_k_head_num_ + self.tp_v_head_num_, :],
            o_tensor.view(-1, self.tp_q_head_num_, self.head_dim_),
            infer_state.b_start_loc,
            infer_state.b_seq_len,
            infer_state.max_len_in_batch,
        )
        return o_tensor

    def _token_attention_kernel(self, q, infer_state, layer_weight, out=None):
        total_token_num = infer_state.total_token_num
        batch_size = infer_state.batch_size
        calcu_shape1 = (batch_size, self.tp_q_head_num_, self.head_dim_)
        att_m_tensor = torch.empty((self.tp_q_head_num_, total_token_num))
        kv_buffer = infer_state.mem_manager.kv_buffer[self.layer_num_]
        llama_token_att_fwd(
            q.view(calcu_shape1), kv_buffer[:, 0 : self.tp_k_head_num_, :], att_m_tensor,
            infer_state.req_manager.req_to_token_indexs, infer_state.b_req_idx,
            infer_state.b_start_loc, infer_state.b_seq_len, infer_state.max_len_in_batch,
        )
        o_tensor = torch.empty_like(q) if out is None else out
        llama_token_softmax_reducev_fwd(
            att_m_tensor, kv_buffer[:, self.tp_k_head_num_ : self.tp_k_head_num_ + self.tp_v_head_num_, :],
            o_tensor.view(calcu_shape1), infer_state.req_manager.req_to_token_indexs,
            infer_state.b_req_idx, infer_state.b_start_loc, infer_state.b_seq_len,
        )
        return o_tensor

    def _get_qkv(self, input, cache_kv, infer_state, layer_weight):
        q = torch.addmm(layer_weight.q_bias_, input.view(-1, self.embed_dim_), layer_weight.q_weight_)
        cache_kv.view(-1, (self.tp_k_head_num_ + self.tp_v_head_num_) * self.head_dim_).copy_(
            torch.addmm(layer_weight.kv_bias_, input.view(-1, self.embed_dim_), layer_weight.kv_weight_)
        )
        rotary_emb_fwd(
            q.view(-1, self.tp_q_head_num_, self.head_dim_),
            cache_kv[:, 0 : self.tp_k_head_num_, :],
            infer_state.position_cos,
            infer_state.position_sin,
        )
        return q, cache_kv

    def _context_attention(self, input_embding, infer_state, layer_weight):
        input1 = rmsnorm(input_embding, layer_weight.att_norm_weight_, self.eps_)
        cache_kv = torch.empty(input1.shape[0], self.tp_k_head_num_ + self.tp_v_head_num_, self.head_dim_)
        q, cache_kv = self._get_qkv(input1, cache_kv, infer_state, layer_weight)
        destindex_copy_kv(cache_kv, infer_state.mem_index, infer_state.mem_manager.kv_buffer[self.layer_num_])
        o = self._context_attention_kernel(q, cache_kv, infer_state, layer_weight)
        input_embding.add_(o.view(-1, self.embed_dim_) @ layer_weight.o_weight_)

    def _token_attention(self, input_embding, infer_state, layer_weight):
        input1 = rmsnorm(input_embding, layer_weight.att_norm_weight_, self.eps_)
        cache_kv = torch.empty(input1.shape[0], self.tp_k_head_num_ + self.tp_v_head_num_, self.head_dim_)
        q, cache_kv = self._get_qkv(input1, cache_kv, infer_state, layer_weight)
        destindex_copy_kv(cache_kv, infer_state.mem_index, infer_state.mem_manager.kv_buffer[self.layer_num_])
        o = self._token_attention_kernel(q, infer_state, layer_weight)
        input_embding.add_(o.view(-1, self.embed_dim_) @ layer_weight.o_weight_)

    def _ffn(self, input_embding, layer_weight):
        x = rmsnorm(input_embding, layer_weight.ffn_norm_weight_, self.eps_)
        gate, up = (x @ layer_weight.gate_up_proj).chunk(2, dim=-1)
        input_embding.add_((torch.nn.functional.silu(gate) * up) @ layer_weight.down_proj)

    def context_forward(self, input_embdings, infer_state, layer_weight):
        self._context_attention(input_embdings, infer_state, layer_weight)
        self._ffn(input_embdings, layer_weight)
        return input_embdings

    def token_forward(self, input_embdings, infer_state, layer_weight):
        self._token_attention(input_embdings, infer_state, layer_weight)
        self._ffn(input_embdings, layer_weight)
        return input_embdings


class Qwen2TransformerLayerInfer(LlamaTransformerLayerInfer):
    def __init__(self, layer_num, network_config):
        super().__init__(layer_num, network_config)
        if not FIXED:
            self._bind_func()

    def _bind_func(self):
        self._token_attention_kernel = self._token_decode_attention_normal
        self._context_attention_kernel = self._context_attention_kernel_window
        return

    def _context_attention_kernel_window(self, q, kv, infer_state, layer_weight, out=None):
        o_tensor = torch.empty_like(q) if out is None else out
        mistral_context_attention_fwd(
            q.view(-1, self.tp_q_head_num_, self.head_dim_),
            kv[:, 0 : self.tp_k_head_num_, :],
            kv[:, self.tp_k_head_num_ : self.tp_k_head_num_ + self.tp_v_head_num_, :],
            o_tensor.view(-1, self.tp_q_head_num_, self.head_dim_),
            infer_state.b_start_loc,
            infer_state.b_seq_len,
            infer_state.max_len_in_batch,
            infer_state.sliding_window,
        )
        return o_tensor

    def _token_decode_attention_normal(self, q, infer_state, layer_weight, out=None):
        total_token_num = infer_state.total_cache_num
        batch_size = infer_state.batch_size
        calcu_shape1 = (batch_size, self.tp_q_head_num_, self.head_dim_)
        att_m_tensor = torch.empty((self.tp_q_head_num_, total_token_num))
        kv_buffer = infer_state.mem_manager.kv_buffer[self.layer_num_]
        mistral_token_att_fwd(
            q.view(calcu_shape1),
            kv_buffer[:, 0 : self.tp_k_head_num_, :],
            att_m_tensor,
            infer_state.req_manager.req_to_token_indexs,
            infer_state.b_req_idx,
            infer_state.b_start_loc,
            infer_state.b_seq_len,
            infer_state.b_att_start_loc,
            infer_state.b_att_seq_len,
            infer_state.sliding_window,
        )
        o_tensor = torch.empty_like(q) if out is None else out
        mistral_token_softmax_reducev_fwd(
            att_m_tensor,
            kv_buffer[:, self.tp_k_head_num_ : self.tp_k_head_num_ + self.tp_v_head_num_, :],
            o_tensor.view(calcu_shape1),
            infer_state.req_manager.req_to_token_indexs,
            infer_state.b_req_idx,
            infer_state.b_start_loc,
            infer_state.b_seq_len,
            infer_state.b_att_start_loc,
            infer_state.b_att_seq_len,
            infer_state.other_kv_index,
            infer_state.sliding_window,
        )
        return o_tensor


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------
class Qwen2TpPartModel:
    transformer_layer_infer_class = Qwen2TransformerLayerInfer
    infer_state_class = LlamaInferStateInfo if FIXED else Qwen2InferStateInfo

    def __init__(self, kvargs):
        self.config = dict(kvargs["config"])
        self.max_total_token_num = kvargs["max_total_token_num"]
        self._init_config()
        cfg = self.config
        self.head_dim_ = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.embed = torch.randn(cfg["vocab_size"], cfg["hidden_size"]) * 0.5
        self.lm_head = torch.randn(cfg["hidden_size"], cfg["vocab_size"]) * 0.5
        self.final_norm = torch.ones(cfg["hidden_size"])
        self.trans_layers_weight = [Qwen2TransformerLayerWeight(cfg) for _ in range(cfg["num_hidden_layers"])]
        self.layers_infer = [self.transformer_layer_infer_class(i, cfg) for i in range(cfg["num_hidden_layers"])]
        self.mem_manager = MemoryManager(
            self.max_total_token_num, cfg["num_key_value_heads"], self.head_dim_, cfg["num_hidden_layers"]
        )
        self.req_manager = ReqManager(kvargs["max_req_num"], kvargs["max_seq_length"])
        self._init_to_get_rotary()

    def _init_config(self):
        if not FIXED:
            if self.config["sliding_window"] is None:
                self.config["sliding_window"] = self.max_total_token_num
        return

    def _init_to_get_rotary(self, default_base=10000):
        base = self.config.get("rope_theta", float(default_base))
        max_seq_len = self.config["max_position_embeddings"]
        inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim_, 2, dtype=torch.float32) / self.head_dim_))
        t = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self._cos_cached = torch.cos(freqs)
        self._sin_cached = torch.sin(freqs)

    @torch.no_grad()
    def forward(self, batch_size, total_token_num, max_len_in_batch, input_ids, b_req_idx, b_start_loc,
                b_seq_len, is_prefill=True):
        infer_state = self.infer_state_class()
        infer_state.is_prefill = is_prefill
        infer_state.batch_size = batch_size
        infer_state.total_token_num = total_token_num
        infer_state.max_len_in_batch = max_len_in_batch
        infer_state.b_req_idx = b_req_idx
        infer_state.b_start_loc = b_start_loc
        infer_state.b_seq_len = b_seq_len
        infer_state.mem_manager = self.mem_manager
        infer_state.req_manager = self.req_manager
        infer_state.mem_index = self.mem_manager.alloc(input_ids.shape[0])
        if is_prefill:
            # init_req_to_token_indexes
            start = 0
            for i in range(batch_size):
                n = int(b_seq_len[i])
                self.req_manager.req_to_token_indexs[int(b_req_idx[i]), :n] = infer_state.mem_index[start : start + n]
                start += n
        else:
            # copy_kv_index_to_req
            for i in range(batch_size):
                self.req_manager.req_to_token_indexs[int(b_req_idx[i]), int(b_seq_len[i]) - 1] = infer_state.mem_index[i]
        infer_state.init_some_extra_state(self, input_ids)

        x = self.embed[input_ids].clone()
        for i in range(self.config["num_hidden_layers"]):
            if is_prefill:
                x = self.layers_infer[i].context_forward(x, infer_state, self.trans_layers_weight[i])
            else:
                x = self.layers_infer[i].token_forward(x, infer_state, self.trans_layers_weight[i])
        if is_prefill:
            last = b_start_loc + b_seq_len - 1
            x = x[last]
        x = rmsnorm(x, self.final_norm, self.config["rms_norm_eps"])
        return x @ self.lm_head


def main():
    # a Qwen1.5-style config.json: a sliding_window value, but use_sliding_window false
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 64,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": 6,
        "use_sliding_window": False,
        "max_window_layers": 2,
    }
    torch.manual_seed(0)
    model = Qwen2TpPartModel({"config": config, "max_total_token_num": 256, "max_req_num": 4, "max_seq_length": 64})

    prompts = [[3, 17, 5, 9, 22, 41, 8, 30, 12, 7, 55], [4, 19, 2, 33, 60, 11, 27, 6]]
    batch_size = len(prompts)
    b_req_idx = torch.arange(batch_size)
    b_seq_len = torch.tensor([len(p) for p in prompts])
    b_start_loc = torch.cumsum(b_seq_len, 0) - b_seq_len
    input_ids = torch.tensor([t for p in prompts for t in p])
    logits = model.forward(batch_size, int(b_seq_len.sum()), int(b_seq_len.max()), input_ids, b_req_idx,
                           b_start_loc, b_seq_len, is_prefill=True)
    print("prefill last-token logits[:, :6]:", logits[:, :6])

    outs = [[] for _ in range(batch_size)]
    for step in range(5):
        next_ids = logits.argmax(-1)
        for i in range(batch_size):
            outs[i].append(int(next_ids[i]))
        b_seq_len = b_seq_len + 1
        b_start_loc = torch.cumsum(b_seq_len, 0) - b_seq_len
        logits = model.forward(batch_size, int(b_seq_len.sum()), int(b_seq_len.max()), next_ids, b_req_idx,
                               b_start_loc, b_seq_len, is_prefill=False)
    for i in range(batch_size):
        print(f"request {i} generated:", outs[i])
    print("final decode logits[:, :6]:", logits[:, :6])


if __name__ == "__main__":
    main()
