# Citation: ModelTC/lightllm @fc72ffab9a3455cfb571f22d45ab777cc29de0de:
#   lightllm/server/router/dynamic_prompt/radix_cache.py (TreeNode, match, RadixCache.insert / match_prefix),
#   lightllm/server/router/model_infer/infer_batch.py (InferReq.init_all: match_prefix on all prompt tokens but the
#   last, req_to_token_indexs[req_idx, 0:ready_cache_len] = value, cur_kv_len; free_a_req_mem: radix insert),
#   lightllm/server/router/model_infer/mode_backend/generic_pre_process.py (prepare_prefill_inputs),
#   lightllm/common/infer_utils.py (init_req_to_token_indexes),
#   lightllm/common/basemodel/triton_kernel/gen_prefill_params.py (gen_prefill_params: positions ready..seq_len,
#   b1_cu_q_seq_len), lightllm/common/basemodel/infer_struct.py (init_some_extra_state: b_start_loc),
#   lightllm/models/llama/infer_struct.py (position_cos / position_sin), lightllm/models/llama/layer_infer/
#   transformer_layer_infer.py (_get_qkv, _context_attention_kernel), lightllm/common/basemodel/layer_infer/template/
#   transformer_layer_infer_template.py (context_forward, _post_cache_kv), lightllm/models/llama/triton_kernel/
#   context_flashattention_nopad.py (context_attention_fwd / _fwd_kernel, written here in torch the way the file's
#   own torch_context_attention_fwd does, with the kernel's kv_group_num and -1.0e6 fill), rotary_emb.py.
# LightLLM's prompt cache: a finished request's prompt KV slots go into a radix tree keyed by token ids; a new request
# whose prompt shares a prefix gets those slots copied into its row of req_to_token_indexs and `cur_kv_len` =
# ready_cache_len, and only its remaining tokens are prefilled. The prefill batch packs the requests' new tokens
# (b_start_loc = cumsum of seq_len - ready_cache_len), positions start at ready_cache_len, the new KV is written to
# freshly allocated slots first, then each query row m attends keys req_to_token_indexs[req, 0:seq_len] with
# `m + prompt_cache_len >= n` (bottom-right causal over cached + new keys, GQA by head // kv_group_num).
# Self-check: every request's whole prompt run alone by transformers' LlamaForCausalLM (same weights, empty cache, no
# mask): final hidden state of every prefilled token, the next-token logits, and the K/V held in each request's slots.
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)


# ---- lightllm/server/router/dynamic_prompt/radix_cache.py (eviction bookkeeping left out) ----
class TreeNode:
    def __init__(self):
        self.children = {}
        self.parent = None
        self.token_id_key = None
        self.token_mem_index_value = None
        self.ref_counter = 0
        self.node_value_len = 0
        self.node_prefix_total_len = 0

    def split_node(self, prefix_len):
        split_parent_node = TreeNode()
        split_parent_node.parent = self.parent
        split_parent_node.parent.children[self.token_id_key[0].item()] = split_parent_node
        split_parent_node.token_id_key = self.token_id_key[0:prefix_len]
        split_parent_node.token_mem_index_value = self.token_mem_index_value[0:prefix_len]
        split_parent_node.children = {}
        split_parent_node.children[self.token_id_key[prefix_len].item()] = self
        split_parent_node.ref_counter = self.ref_counter

        new_len = len(split_parent_node.token_mem_index_value)
        split_parent_node.node_value_len = new_len
        split_parent_node.node_prefix_total_len = split_parent_node.parent.node_prefix_total_len + new_len

        self.token_id_key = self.token_id_key[prefix_len:]
        self.token_mem_index_value = self.token_mem_index_value[prefix_len:]
        self.parent = split_parent_node
        new_len = len(self.token_mem_index_value)
        self.node_value_len = new_len
        self.node_prefix_total_len = self.parent.node_prefix_total_len + new_len
        return split_parent_node

    def add_and_return_new_child(self, token_id_key, token_mem_index_value):
        child = TreeNode()
        child.token_id_key = token_id_key
        child.token_mem_index_value = token_mem_index_value
        first_token_key = child.token_id_key[0].item()
        assert first_token_key not in self.children.keys()
        self.children[first_token_key] = child
        child.parent = self
        new_len = len(child.token_mem_index_value)
        child.node_value_len = new_len
        child.node_prefix_total_len = child.parent.node_prefix_total_len + new_len
        return child

    def is_leaf(self):
        return len(self.children) == 0


def match(t1: torch.Tensor, t2: torch.Tensor) -> int:
    t1_flat = t1.flatten()
    t2_flat = t2.flatten()
    min_len = min(t1_flat.size(0), t2_flat.size(0))
    diff = t1_flat[:min_len] != t2_flat[:min_len]
    mismatch_indices = torch.nonzero(diff)
    if mismatch_indices.numel() == 0:
        return min_len
    else:
        return mismatch_indices[0].item()


class RadixCache:
    def __init__(self):
        self.root_node = TreeNode()
        self.root_node.token_id_key = torch.zeros((0,), dtype=torch.int64)
        self.root_node.token_mem_index_value = torch.zeros((0,), dtype=torch.int64)
        self.root_node.ref_counter = 1

    def insert(self, key, value=None):
        if value is None:
            value = key
        assert len(key) == len(value)
        if len(key) == 0:
            return 0
        return self._insert_helper(self.root_node, key, value)

    def _insert_helper(self, node: TreeNode, key, value):
        first_key_id = key[0].item()
        if first_key_id in node.children.keys():
            child: TreeNode = node.children[first_key_id]
            prefix_len = match(key, child.token_id_key)
            if prefix_len == len(key):
                return prefix_len
            elif prefix_len < len(key) and prefix_len < len(child.token_id_key):
                key = key[prefix_len:]
                value = value[prefix_len:]
                split_parent_node = child.split_node(prefix_len)
                split_parent_node.add_and_return_new_child(key, value)
                return prefix_len
            elif prefix_len < len(key) and prefix_len == len(child.token_id_key):
                return prefix_len + self._insert_helper(child, key[prefix_len:], value[prefix_len:])
            else:
                assert False, "can not run to here"
        else:
            node.add_and_return_new_child(key, value)
            return 0

    def match_prefix(self, key, update_refs=False):
        assert len(key) != 0
        ans_value_list = []
        tree_node = self._match_prefix_helper(self.root_node, key, ans_value_list, update_refs=update_refs)
        if tree_node != self.root_node:
            if len(ans_value_list) != 0:
                value = torch.concat(ans_value_list)
            else:
                value = torch.zeros((0,), dtype=torch.int64)
            return tree_node, len(value), value
        else:
            return None, 0, None

    def _match_prefix_helper(self, node: TreeNode, key, ans_value_list: list, update_refs=False) -> TreeNode:
        if update_refs:
            node.ref_counter += 1
        if len(key) == 0:
            return node
        first_key_id = key[0].item()
        if first_key_id not in node.children.keys():
            return node
        else:
            child = node.children[first_key_id]
            prefix_len = match(key, child.token_id_key)
            if prefix_len == len(child.token_id_key):
                ans_value_list.append(child.token_mem_index_value)
                return self._match_prefix_helper(child, key[prefix_len:], ans_value_list, update_refs=update_refs)
            elif prefix_len < len(child.token_id_key):
                split_parent_node = child.split_node(prefix_len)
                ans_value_list.append(split_parent_node.token_mem_index_value)
                if update_refs:
                    split_parent_node.ref_counter += 1
                return split_parent_node
            else:
                assert False, "error state"


# ---- lightllm/common/mem_manager.py / req_manager.py, reduced to what the prefill touches ----
class MemoryManager:
    def __init__(self, size, layer_num, kv_head_num, head_dim):
        self.kv_buffer = [torch.zeros(size, 2 * kv_head_num, head_dim) for _ in range(layer_num)]
        self.free = torch.randperm(size).tolist()  # slots handed out in no particular order

    def alloc(self, need_size):
        out, self.free = self.free[:need_size], self.free[need_size:]
        return torch.tensor(out, dtype=torch.int64)


class ReqManager:
    def __init__(self, max_request_num, max_sequence_length, mem_manager):
        self.req_to_token_indexs = torch.zeros((max_request_num, max_sequence_length), dtype=torch.int32)
        self.mem_manager = mem_manager
        self.free_idx = list(range(max_request_num))

    def alloc(self):
        return self.free_idx.pop(0)


class InferReq:
    def __init__(self, prompt_ids, req_manager, radix_cache):
        self.input_token_ids = list(prompt_ids)
        self.req_idx = req_manager.alloc()
        self.shared_kv_node = None
        self.cur_kv_len = 0
        # InferReq.init_all
        if radix_cache is not None and len(self.input_token_ids) > 1:
            key = torch.tensor(self.input_token_ids, dtype=torch.int64)
            key = key[0 : len(key) - 1]  # the last token is always prefilled, it yields the next token
            share_node, kv_len, value_tensor = radix_cache.match_prefix(key, update_refs=True)
            if share_node is not None:
                self.shared_kv_node = share_node
                ready_cache_len = share_node.node_prefix_total_len
                req_manager.req_to_token_indexs[self.req_idx, 0:ready_cache_len] = value_tensor.to(torch.int32)
                self.cur_kv_len = int(ready_cache_len)

    def get_input_token_ids(self):
        return self.input_token_ids


def prepare_prefill_inputs(req_objs, mem_manager):
    total_token_num = 0
    max_len_in_batch = 0
    input_ids, b_req_idx, b_seq_len, b_ready_cache_len = [], [], [], []
    for req in req_objs:
        b_req_idx.append(req.req_idx)
        input_token_ids = req.get_input_token_ids()
        seq_len = len(input_token_ids)
        input_token_len = seq_len - req.cur_kv_len
        input_id = input_token_ids[req.cur_kv_len :]
        b_seq_len.append(seq_len)
        input_ids.extend(input_id)
        total_token_num += seq_len
        max_len_in_batch = max(max_len_in_batch, input_token_len)
        b_ready_cache_len.append(req.cur_kv_len)
    input_ids = torch.tensor(input_ids, dtype=torch.int64)
    mem_indexes = mem_manager.alloc(input_ids.shape[0])
    return dict(batch_size=len(req_objs), total_token_num=total_token_num, max_len_in_batch=max_len_in_batch,
                input_ids=input_ids, mem_indexes=mem_indexes, b_req_idx=torch.tensor(b_req_idx, dtype=torch.int32),
                b_seq_len=torch.tensor(b_seq_len, dtype=torch.int32),
                b_ready_cache_len=torch.tensor(b_ready_cache_len, dtype=torch.int32))


def init_req_to_token_indexes(req_to_token_indexs, b_req_idx, b_seq_len, b_ready_cache_len, max_len_in_batch,
                              alloc_mem_index):
    start_index = 0
    b_seq_len_numpy = b_seq_len.cpu().numpy()
    b_ready_cache_len_numpy = b_ready_cache_len.cpu().numpy()
    b_req_idx_numpy = b_req_idx.cpu().numpy()
    for i in range(len(b_seq_len)):
        cur_seq_len = b_seq_len_numpy[i]
        cur_ready_cache_len = b_ready_cache_len_numpy[i]
        req_to_token_indexs[b_req_idx_numpy[i], cur_ready_cache_len:cur_seq_len] = alloc_mem_index[
            start_index : start_index + cur_seq_len - cur_ready_cache_len
        ].to(torch.int32)
        start_index += cur_seq_len - cur_ready_cache_len
    return


def gen_prefill_params(input_token_num, b_ready_cache_len, b_seq_len):
    b_q_seq_len = b_seq_len - b_ready_cache_len
    b1_cu_q_seq_len = torch.zeros(b_q_seq_len.shape[0] + 1, dtype=torch.int32)
    b1_cu_q_seq_len[1:] = torch.cumsum(b_q_seq_len, 0)
    position_ids = torch.empty((input_token_num,), dtype=torch.int64)
    for b in range(b_seq_len.shape[0]):  # _gen_prefill_position
        ready_len, seq_len = int(b_ready_cache_len[b]), int(b_seq_len[b])
        dest_start = int(b1_cu_q_seq_len[b])
        position_ids[dest_start : dest_start + seq_len - ready_len] = torch.arange(ready_len, seq_len)
    return b_q_seq_len, b1_cu_q_seq_len, position_ids


# ---- lightllm/models/llama/triton_kernel/context_flashattention_nopad.py: context_attention_fwd in torch ----
def context_attention_fwd(q, k, v, o, b_req_idx, b_start_loc, b_seq_len, b_prompt_cache_len, max_input_len,
                          req_to_token_indexs):
    sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    head = q.shape[1]
    kv_group_num = q.shape[1] // k.shape[1]
    for cur_batch in range(b_seq_len.shape[0]):
        cur_batch_in_all_start_index = int(b_start_loc[cur_batch])
        prompt_cache_len = int(b_prompt_cache_len[cur_batch])
        cur_batch_seq_len = int(b_seq_len[cur_batch]) - prompt_cache_len
        cur_batch_req_idx = int(b_req_idx[cur_batch])
        block_end_loc = cur_batch_seq_len + prompt_cache_len
        kv_loc = req_to_token_indexs[cur_batch_req_idx, 0:block_end_loc].long()
        offs_m = torch.arange(cur_batch_seq_len)
        offs_n = torch.arange(block_end_loc)
        mask = offs_m[:, None] + prompt_cache_len >= offs_n[None, :]
        for cur_head in range(head):
            cur_kv_head = cur_head // kv_group_num
            cur_q = q[cur_batch_in_all_start_index : cur_batch_in_all_start_index + cur_batch_seq_len, cur_head]
            cur_k = k[kv_loc, cur_kv_head]
            cur_v = v[kv_loc, cur_kv_head]
            qk = cur_q @ cur_k.T * sm_scale + torch.where(mask, 0.0, -1.0e6)
            p = torch.softmax(qk, dim=-1)
            o[cur_batch_in_all_start_index : cur_batch_in_all_start_index + cur_batch_seq_len, cur_head] = p @ cur_v


def rotary_emb_fwd(q, k, cos, sin):
    d = q.shape[-1] // 2
    for x in (q, k):
        x0, x1 = x[..., :d].clone(), x[..., d:].clone()
        x[..., :d] = x0 * cos[:, None, :] - x1 * sin[:, None, :]
        x[..., d:] = x0 * sin[:, None, :] + x1 * cos[:, None, :]


def rmsnorm_forward(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


class LightLlamaPrefill:
    """The prefill path of lightllm's llama (pre layer, transformer layers' context_forward, post layer)."""

    def __init__(self, hf: LlamaForCausalLM, req_manager):
        cfg = hf.config
        self.hf = hf
        self.req_manager = req_manager
        self.mem_manager = req_manager.mem_manager
        self.eps_ = cfg.rms_norm_eps
        self.tp_q_head_num_ = cfg.num_attention_heads
        self.tp_k_head_num_ = cfg.num_key_value_heads
        self.tp_v_head_num_ = cfg.num_key_value_heads
        self.head_dim_ = cfg.hidden_size // cfg.num_attention_heads
        base = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
        inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim_, 2, dtype=torch.float32) / self.head_dim_))
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self._cos_cached = torch.cos(freqs)
        self._sin_cached = torch.sin(freqs)

    @torch.no_grad()
    def forward(self, model_input):
        infer_state = dict(model_input)
        init_req_to_token_indexes(self.req_manager.req_to_token_indexs, model_input["b_req_idx"],
                                  model_input["b_seq_len"], model_input["b_ready_cache_len"],
                                  model_input["max_len_in_batch"], model_input["mem_indexes"])
        b_q_seq_len, b1_cu_q_seq_len, position_ids = gen_prefill_params(
            model_input["input_ids"].shape[0], model_input["b_ready_cache_len"], model_input["b_seq_len"])
        infer_state["b_start_loc"] = b1_cu_q_seq_len[0:-1]
        position_cos = torch.index_select(self._cos_cached, 0, position_ids)
        position_sin = torch.index_select(self._sin_cached, 0, position_ids)

        m = self.hf.model
        x = m.embed_tokens(model_input["input_ids"])
        for layer_num, layer in enumerate(m.layers):
            a = rmsnorm_forward(x, layer.input_layernorm.weight, self.eps_)
            # _get_qkv: q and the fused kv projection, rotary on q and k
            q = layer.self_attn.q_proj(a).view(-1, self.tp_q_head_num_, self.head_dim_)
            cache_kv = torch.cat([layer.self_attn.k_proj(a), layer.self_attn.v_proj(a)], dim=-1).view(
                -1, self.tp_k_head_num_ + self.tp_v_head_num_, self.head_dim_)
            rotary_emb_fwd(q, cache_kv[:, 0 : self.tp_k_head_num_, :], position_cos, position_sin)
            # _post_cache_kv: destindex_copy_kv into the slots just allocated
            self.mem_manager.kv_buffer[layer_num][model_input["mem_indexes"]] = cache_kv
            # _context_attention_kernel
            o = torch.empty_like(q)
            kv = self.mem_manager.kv_buffer[layer_num]
            context_attention_fwd(
                q, kv[:, 0 : self.tp_k_head_num_, :],
                kv[:, self.tp_k_head_num_ : self.tp_k_head_num_ + self.tp_v_head_num_, :], o,
                infer_state["b_req_idx"], infer_state["b_start_loc"], infer_state["b_seq_len"],
                infer_state["b_ready_cache_len"], infer_state["max_len_in_batch"],
                self.req_manager.req_to_token_indexs)
            x = x + layer.self_attn.o_proj(o.view(o.shape[0], -1))
            f = rmsnorm_forward(x, layer.post_attention_layernorm.weight, self.eps_)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(f)) * layer.mlp.up_proj(f))
        hidden = rmsnorm_forward(x, m.norm.weight, self.eps_)
        # post layer: one logits row per request, at its last new token
        last_index = (b1_cu_q_seq_len[1:] - 1).long()
        logits = self.hf.lm_head(hidden[last_index])
        return hidden, logits, b1_cu_q_seq_len


def main():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                      attn_implementation="eager")
    hf = LlamaForCausalLM(cfg).eval()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mem_manager = MemoryManager(200, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
    req_manager = ReqManager(8, 48, mem_manager)
    radix_cache = RadixCache()
    engine = LightLlamaPrefill(hf, req_manager)

    g = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(1, 64, (n,), generator=g).tolist()

    system = toks(10)
    prompt_a = system + toks(5)
    prompt_c = toks(7)
    prompt_b = system + toks(6)             # hits the first 10 tokens of A (the tree node is split)
    prompt_d = prompt_a + toks(3)           # hits all 15 of A
    prompt_e = toks(4)                      # no hit
    prompt_f = list(prompt_a)               # same prompt as A: the last token is still prefilled

    def run_batch(prompts):
        reqs = [InferReq(p, req_manager, radix_cache) for p in prompts]
        model_input = prepare_prefill_inputs(reqs, mem_manager)
        hidden, logits, cu = engine.forward(model_input)
        for r in reqs:
            r.cur_kv_len = len(r.get_input_token_ids())
        return reqs, model_input, hidden, logits, cu

    results = []
    results.append(run_batch([prompt_a, prompt_c]))
    # A and C finish: free_a_req_mem with the radix cache inserts their prompt slots
    for r in results[0][0]:
        key = torch.tensor(r.get_input_token_ids()[0 : r.cur_kv_len], dtype=torch.int64)
        value = req_manager.req_to_token_indexs[r.req_idx][: r.cur_kv_len].detach().long()
        radix_cache.insert(key, value)
    results.append(run_batch([prompt_b, prompt_d, prompt_e, prompt_f]))
    assert results[1][1]["b_ready_cache_len"].tolist() == [10, 15, 0, 14]

    tol = dict(rtol=1e-4, atol=1e-4)
    checked = 0
    with torch.no_grad():
        for reqs, model_input, hidden, logits, cu in results:
            for i, r in enumerate(reqs):
                ids = torch.tensor([r.get_input_token_ids()])
                ref = hf(input_ids=ids, output_hidden_states=True, use_cache=True)
                ref_hidden = ref.hidden_states[-1][0]
                ready = int(model_input["b_ready_cache_len"][i])
                got = hidden[int(cu[i]) : int(cu[i + 1])]
                torch.testing.assert_close(got, ref_hidden[ready:], **tol)
                torch.testing.assert_close(logits[i], ref.logits[0, -1], **tol)
                # every slot in the request's row (cached and new) holds this prompt's K / V at that position
                slots = req_manager.req_to_token_indexs[r.req_idx, : ids.shape[1]].long()
                for layer_num in range(cfg.num_hidden_layers):
                    layer_cache = ref.cache.layers[layer_num]
                    k_ref = layer_cache.keys[0].transpose(0, 1)
                    v_ref = layer_cache.values[0].transpose(0, 1)
                    kv = mem_manager.kv_buffer[layer_num][slots]
                    torch.testing.assert_close(kv[:, : cfg.num_key_value_heads], k_ref, **tol)
                    torch.testing.assert_close(kv[:, cfg.num_key_value_heads :], v_ref, **tol)
                checked += 1
    print("ok: %d requests (prompt-cache hits of 10, 15, 0 and 14 tokens) match each prompt run alone" % checked)


if __name__ == "__main__":
    main()
