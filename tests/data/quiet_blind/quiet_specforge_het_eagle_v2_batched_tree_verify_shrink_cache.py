# Correct program (quiet batch quiet-r150a).
# Ported from w32zhong/specforge_PoC @b5c203ee4ee945b55b73cef6acde27cfe463db50,
# specforge_het/models/algorithms/eagle_v2.py (EAGLE-2 dynamic tree decoding over transformers' DynamicCache):
#   finalize_mask (1 = visible -> 0, 0 -> finfo.min), shrink_cache (gather the accepted rows of the verify
#   block and copy them back to past_seq_len.., then slice the cache), EagleV2.prefill_base_model,
#   prefill_draft_model, prebuilt_position_embeddings, speculative_generate, topk_tokens, get_all_top_nodes,
#   construct_row_map, extract_tree_mask (eye + column 0, each row OR-ed with its parent's row; positions =
#   row sums - 1), extract_leaf_root_paths, dynamic_draft_indices, dynamic_draft (tree_depth_mask: the rows of
#   the parents plus an eye per depth, draft keys appended to the draft cache), verify (tree mask padded on the
#   left with past_seq_len ones, positions past_seq_len + depth, decoder layers called one by one over base_kv)
#   and reset_kv_cache.
# Trimmed: the timer is a no-op, training code is gone, the draft model is one Qwen3 decoder layer with
# eagle_fc = Linear(2H, H) on top (specforge_het/models/speculative_qwen3), base is Qwen3ForCausalLM from a tiny
# Qwen3Config with random weights (float64). One sequence (B = 1), as the project's accept step indexes it.
# transformers 5 calls the decoder layers' cache argument `cache` (the project passed `past_key_value=`).
# Checks: every node of every verified tree gets the logits of a plain causal run of the target over the text
# so far plus its root-to-node path (no cache, no mask); the base cache after shrink_cache equals a fresh
# prefill over the accepted text; and the emitted tokens equal plain greedy decoding of the target.
import types

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

torch.manual_seed(0)
torch.set_num_threads(1)  # tiny matrices: threads only add overhead


def finalize_mask(mask):  # 0 -> -infty,  1 -> 0
    if mask is None:
        return None
    inv_mask = 1.0 - mask
    final_mask = inv_mask.masked_fill(inv_mask.to(torch.bool), torch.finfo(mask.dtype).min)
    return final_mask


def shrink_cache(cache, past_seq_len, select_indices=None):
    if select_indices is not None:
        B, S = select_indices.shape
        B, H, _, D = cache.shape
        select_indices = select_indices.to(cache.device)

        idx = select_indices[:, None, :, None].expand(B, H, S, D)
        src = torch.gather(cache, dim=2, index=idx)

        dst = cache[..., past_seq_len: past_seq_len + S, :]
        dst.copy_(src, non_blocking=False)

        new_cache = cache[..., : past_seq_len + S, :]
    else:
        new_cache = cache[..., :past_seq_len, :]
    return new_cache


class TimeStats:
    def start(self, name):
        pass

    def stop(self, name):
        pass


class EagleV2:

    def prepare_inference(self, inference_configs):
        self.eval()
        self.inference_configs = inference_configs
        self.timer = TimeStats()

    def prefill_base_model(self, inputs_embeds, attention_mask):
        base_kv = DynamicCache()
        base_outputs = self.base_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            use_cache=True,
            cache=base_kv,
            output_hidden_states=True,
            return_dict=True,
        )
        assert base_kv.get_seq_length() > 0
        return base_outputs.last_hidden_state, base_kv

    def prefill_draft_model(self, inputs_embeds, prev_states, *, attention_mask=None, draft_kv=None):
        prev_states = prev_states.to(self.draft_model.device)
        inputs_embeds = inputs_embeds.to(self.draft_model.device)

        inputs_embeds_concate = self.draft_model.eagle_fc(torch.cat((inputs_embeds, prev_states), dim=-1))

        draft_kv = DynamicCache() if draft_kv is None else draft_kv
        _ = self.draft_model(
            inputs_embeds=inputs_embeds_concate,
            attention_mask=attention_mask,
            use_cache=True,
            cache=draft_kv,
        )
        return draft_kv

    def prebuilt_position_embeddings(self, inputs_embeds):
        max_length = (inputs_embeds.shape[1]
                      + self.inference_configs.max_new_tokens
                      + self.inference_configs.dynamic_draft_max_depth + 1)
        max_length = min(self.get_max_ctx_length(), max_length)
        cache_position = torch.arange(0, max_length, device=inputs_embeds.device)
        position_ids = cache_position.unsqueeze(0)
        return self.get_positional_embedding(inputs_embeds, position_ids)

    def speculative_generate(self, input_ids, attention_mask, **kwargs):
        inputs_embeds = self.get_token_embedding(input_ids)
        position_embeddings = self.prebuilt_position_embeddings(inputs_embeds)

        hidden_states, base_kv = self.prefill_base_model(inputs_embeds, attention_mask)
        prev_states, last_states = hidden_states[:, :-1], hidden_states[:, -1:]

        logits = self.get_token_logits(last_states)
        next_root = logits.argmax(dim=-1)
        yield next_root

        draft_kv = self.prefill_draft_model(inputs_embeds[:, 1:], prev_states,
                                            attention_mask=attention_mask[:, 1:])

        #  pre-fill  |draft tree | verify |next_root
        # h1 h2 h3 h4|~~~~~~~~~~ |h5 h6 h7|
        #   \draft\  |           |        |
        # t1 t2 t3 t4|t5 ~~~~~~~~|t5 t6 t7|t8
        draft_indices = self.dynamic_draft_indices(input_ids.shape[0])

        while True:
            # past_seq_len is derived from base_kv because
            # base_kv length is more stable.
            past_seq_len = base_kv.get_seq_length()

            draft_outputs = self.dynamic_draft(
                draft_kv, position_embeddings, past_seq_len - 1,
                next_root, last_states, **draft_indices
            )

            accept_tokens, accept_idx, hidden_states = self.verify(
                base_kv, position_embeddings, past_seq_len,
                draft_indices['idx_B'], **draft_outputs
            )

            self.reset_kv_cache(base_kv, draft_kv, past_seq_len, accept_idx)

            yield accept_tokens

            if accept_tokens.shape[-1] > 1:
                prev_states, last_states = hidden_states[:, :-1], hidden_states[:, -1:]
                prefill_tokens, next_root = accept_tokens[:, :-1], accept_tokens[:, -1:]
                inputs_embeds = self.get_token_embedding(prefill_tokens)
                draft_kv = self.prefill_draft_model(inputs_embeds, prev_states, draft_kv=draft_kv)
            else:
                last_states = hidden_states
                next_root = accept_tokens

    def topk_tokens(self, hiddens, top_k):
        logits = self.get_token_logits(hiddens)
        logsoftmax = torch.nn.LogSoftmax(dim=-1)
        logprobs = logsoftmax(logits).to(self.draft_model.device)
        top = torch.topk(logprobs, top_k, dim=-1)
        return top.indices, top.values

    # for top_k = 2
    #          top_tokens  top_path_idx  parent    cat_parent
    #            R (root)                          [-1,
    # depth 0: 0   1       [-1, -1]      [-1, -1]   0, 1,
    # depth 1: X X 4 5     [0, 1]        [0, 1]     5, 4,
    # depth 2: X 7 8 X     [3, 2]  +2  = [5, 4]     8, 7]
    # parent_ID = cat_parent[node_ID // top_k]
    def get_all_top_nodes(self, parent_Q, draft_Q, score_Q, top_k, all_top_k):
        B = draft_Q[0].shape[0]
        cat_parent = torch.cat(parent_Q, dim=1)[:, top_k - 1:]  # [B, 1 + (max_depth - 1) x top_k]
        cat_tokens = torch.cat(draft_Q, dim=1).view(B, -1)  # [B, top_k + (max_depth - 1) x top_k^2]
        cat_scores = torch.cat(score_Q, dim=1).view(B, -1)

        top_nodes = torch.topk(cat_scores, all_top_k, dim=-1).indices  # [B, all_top_k]
        ranked_top_nodes = torch.sort(top_nodes, dim=-1).values  # for later getting masks bottom-up
        return ranked_top_nodes, cat_parent, cat_tokens

    @staticmethod
    def construct_row_map(ranked_top_nodes, ranked_top_nodes_parents):
        B = ranked_top_nodes.shape[0]
        row_map = torch.searchsorted(ranked_top_nodes, ranked_top_nodes_parents)
        row_map[ranked_top_nodes_parents == -1] = -1
        row_map = row_map.cpu()
        # to include draft root: prepend zeros and offset-by-one:
        zeros = torch.zeros((B, 1), dtype=torch.long)
        row_map = torch.cat((zeros, row_map + 1), dim=-1)
        return row_map

    #       R 0 1 4 5 7 8
    #       -------------
    #    R |1
    #    0 |1 1
    #    1 |1   1
    #    4 |1   1 1
    #    5 |1   1   1
    #    7 |1     1   1
    #    8 |1       1   1
    @staticmethod
    def extract_tree_mask(idx_B, row_map, all_top_k):
        B = row_map.shape[0]
        tree_mask = torch.eye(all_top_k + 1).int()
        tree_mask[:, 0] = 1
        tree_mask = tree_mask.expand(B, -1, -1)
        for row in range(1, all_top_k + 1):
            parent_row = tree_mask[idx_B, row_map[:, row]]
            tree_mask[idx_B, row] |= parent_row

        tree_positions = torch.sum(tree_mask, dim=-1) - 1
        return tree_mask, tree_positions

    @staticmethod
    def extract_leaf_root_paths(row_map, max_depth, tree_mask, tree_positions):
        col_sum = tree_mask.sum(dim=1)
        is_leaf = (col_sum == 1)
        n_leaves, leaves = is_leaf.sum(dim=-1), is_leaf.nonzero()

        B = row_map.shape[0]
        leaf_root_paths = torch.zeros(B, n_leaves.max().item(), max_depth + 1, dtype=torch.long) - 1
        L = leaves.size(0)
        idx_L = torch.arange(L)

        curr_batches, curr_rows = leaves[:, 0], leaves[:, 1]
        for _ in range(max_depth + 1):
            depths = tree_positions[curr_batches, curr_rows]
            leaf_root_paths[curr_batches, idx_L, depths] = curr_rows
            curr_rows = row_map[curr_batches, curr_rows]
        return leaf_root_paths

    def dynamic_draft_indices(self, B):
        top_k = self.inference_configs.dynamic_draft_top_k
        all_top_k = self.inference_configs.dynamic_draft_all_top_k
        max_depth = self.inference_configs.dynamic_draft_max_depth
        device = self.draft_model.device

        zero_posi = torch.zeros(top_k, device=device, dtype=torch.long)
        eye = torch.eye(top_k, device=device, dtype=self.dtype)
        batched_eye = eye.expand(B, -1, -1)
        attn_eye = finalize_mask(batched_eye)
        idx_B1 = torch.arange(B)[:, None]  # cpu
        idx_B2 = torch.arange(B)[:, None].to(device)
        idx_B3 = torch.arange(B)[:, None].to(self.base_model.device)
        top_path_idx = torch.zeros((B, top_k), device=device, dtype=torch.long)
        tree_size = all_top_k + 1
        draft_token_buff = torch.zeros((B, tree_size + 1), dtype=torch.long, device=self.base_model.device) - 100
        return dict(top_k=top_k, all_top_k=all_top_k, max_depth=max_depth,
                    zero_posi=zero_posi, attn_eye=attn_eye, idx_B=(idx_B1, idx_B2, idx_B3),
                    top_path_idx=top_path_idx, draft_token_buff=draft_token_buff)

    def dynamic_draft(self, draft_kv, position_embeddings, past_seq_len,
                      next_root, last_states, *, top_k, all_top_k, max_depth, zero_posi,
                      attn_eye, idx_B, top_path_idx, draft_token_buff):
        B = next_root.shape[0]
        draft_device = self.draft_model.device

        top_path_logprobs = torch.zeros((B, 1), device=draft_device)

        # previous context tokens are fully visible to root
        tree_depth_mask = torch.zeros((B, 1, past_seq_len + 1), device=draft_device, dtype=self.dtype)

        draft_Q, parent_Q, score_Q = [], [], []
        draft_tokens = next_root

        for depth in range(max_depth):
            inputs_embeds = self.get_token_embedding(draft_tokens)  # [B, n_draft_tokens, H]
            inputs_embeds = inputs_embeds.to(draft_device)
            last_states = last_states.to(draft_device)
            hidden_states = self.draft_model.eagle_fc(torch.cat((inputs_embeds, last_states), dim=-1))

            n_draft_tokens = inputs_embeds.shape[1]
            tree_depth_pos = (past_seq_len + depth) + zero_posi[:n_draft_tokens]

            for decoder_layer in self.draft_model.layers:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=tree_depth_mask.unsqueeze(1),
                    position_embeddings=(
                        position_embeddings[0][:, tree_depth_pos, :],
                        position_embeddings[1][:, tree_depth_pos, :],
                    ),
                    use_cache=True,
                    cache=draft_kv,
                )
            hidden_states = self.draft_model.norm(hidden_states)

            # get top_k tokens from *each* children of this level, use top_tokens as nodes of this level.
            top_tokens, top_logprobs = self.topk_tokens(hidden_states, top_k)

            top_path_logprobs = top_logprobs + top_path_logprobs.unsqueeze(-1)

            draft_Q.append(top_tokens)  # token nodes of this depth
            score_Q.append(top_path_logprobs)  # score nodes of this depth

            if depth == 0:
                base = -1  # [-1, -1, ..., -1]
            elif depth == 1:
                base = 0  # +[0, 1, 2, ..., 9]
            else:
                beam_width = top_k ** 2
                base = top_k + (depth - 2) * beam_width
            parent_nodes = base + top_path_idx
            parent_Q.append(parent_nodes)

            # select top_k tokens out of all the nodes of this level.
            top_path = torch.topk(top_path_logprobs.view(B, -1), top_k, dim=-1)

            top_path_idx, top_path_logprobs = top_path.indices, top_path.values
            parent_idx = top_path_idx // top_k  # [B, 10]

            # only the selected top_k nodes are going to be "expanded".
            draft_tokens = torch.gather(top_tokens.view(B, -1), dim=-1, index=top_path_idx)

            last_states = hidden_states[idx_B[1], parent_idx]  # [B, 10, H]
            select_rows = tree_depth_mask[idx_B[1], parent_idx]  # [B, 10, n_col]
            tree_depth_mask = torch.cat((select_rows, attn_eye), dim=-1)

        ranked_top_nodes, parents, tokens = self.get_all_top_nodes(parent_Q, draft_Q, score_Q, top_k, all_top_k)

        ranked_top_nodes_parents = parents[idx_B[1], ranked_top_nodes // top_k]
        row_map = self.construct_row_map(ranked_top_nodes, ranked_top_nodes_parents)
        draft_token_buff[:, 0] = next_root
        draft_token_buff[:, 1:-1] = tokens[idx_B[1], ranked_top_nodes]

        tree_mask, tree_positions = self.extract_tree_mask(idx_B[0], row_map, all_top_k)
        leaf_root_paths = self.extract_leaf_root_paths(row_map, max_depth, tree_mask, tree_positions)

        return dict(draft_token_buff=draft_token_buff, tree_mask=tree_mask,
                    tree_positions=tree_positions, leaf_root_paths=leaf_root_paths)

    def verify(self, base_kv, position_embeddings, past_seq_len, idx_B, *,
               draft_token_buff, tree_mask, tree_positions, leaf_root_paths):
        hidden_states = self.get_token_embedding(draft_token_buff[..., :-1])

        ext_tree_mask = torch.nn.functional.pad(tree_mask, (past_seq_len, 0), value=1).to(dtype=hidden_states.dtype)

        ext_tree_positions = past_seq_len + tree_positions

        assert len(self.base_model.layers) == self.config.num_hidden_layers
        for decoder_layer in self.base_model.layers:
            ext_tree_mask = ext_tree_mask.to(hidden_states.device)
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=finalize_mask(ext_tree_mask).unsqueeze(1),
                position_embeddings=(
                    position_embeddings[0][idx_B[1], ext_tree_positions],
                    position_embeddings[1][idx_B[1], ext_tree_positions],
                ),
                use_cache=True,
                cache=base_kv,
            )
        hidden_states = self.base_model.norm(hidden_states)

        logits = self.get_token_logits(hidden_states)
        next_tokens = logits.argmax(dim=-1)

        next_tokens = next_tokens.to(self.base_model.device)
        leaf_root_paths = leaf_root_paths.to(self.base_model.device)

        draft_paths = draft_token_buff[idx_B[2], leaf_root_paths][..., 1:]
        truth_paths = next_tokens[idx_B[2], leaf_root_paths]

        match_paths = (draft_paths == truth_paths[..., :-1]).cumprod(dim=-1)
        match_length, match_idx = match_paths.sum(-1).topk(k=1)
        # since we only care about top-1 here, no need for the last dimension.
        idx_B, match_length_and_bonus, match_idx = (
            idx_B[2].squeeze(-1), match_length.squeeze(-1) + 1, match_idx.squeeze(-1)
        )  # shape: [B]
        accept_tokens = truth_paths[idx_B, match_idx, :match_length_and_bonus]
        accept_idx = leaf_root_paths[idx_B, match_idx, :match_length_and_bonus]
        accept_states = hidden_states.to(idx_B.device)[idx_B, accept_idx]

        return accept_tokens, accept_idx, accept_states

    def reset_kv_cache(self, base_kv, draft_kv, past_seq_len, indices):
        select_indices = past_seq_len + indices
        for layer in base_kv.layers:
            layer.keys = shrink_cache(layer.keys, past_seq_len, select_indices)
            layer.values = shrink_cache(layer.values, past_seq_len, select_indices)
        for layer in draft_kv.layers:
            layer.keys = shrink_cache(layer.keys, past_seq_len)
            layer.values = shrink_cache(layer.values, past_seq_len)


class SpeculativeQwen3ForCausalLM(Qwen3ForCausalLM, EagleV2):
    """Base model plus an attached EAGLE draft model (specforge_het/specforge_lm.py style accessors)."""

    def attach_draft_model(self, draft_config):
        self.draft_model = Qwen3Model(draft_config)
        del self.draft_model.embed_tokens  # the draft reads the base model's embeddings
        hidden_size = self.get_hidden_size()
        self.draft_model.eagle_fc = torch.nn.Linear(2 * hidden_size, hidden_size, bias=True)

    @property
    def base_model(self):
        return self.model

    def get_hidden_size(self):
        return self.config.hidden_size

    def get_max_ctx_length(self):
        return self.config.max_position_embeddings

    def get_token_embedding(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def get_token_logits(self, hidden_states):
        return self.lm_head(hidden_states)

    def get_positional_embedding(self, x, position_ids):
        return self.model.rotary_emb(x, position_ids)


def plain_greedy(model, input_ids, n_new):
    ids = input_ids
    for _ in range(n_new):
        logits = model(input_ids=ids).logits
        ids = torch.cat((ids, logits[:, -1:].argmax(-1)), dim=-1)
    return ids[0, input_ids.shape[1]:].tolist()


def main():
    sizes = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    config = Qwen3Config(num_hidden_layers=2, **sizes)
    draft_config = Qwen3Config(num_hidden_layers=1, **sizes)
    model = SpeculativeQwen3ForCausalLM(config)
    model.attach_draft_model(draft_config)
    model = model.to(torch.float64)

    inference_configs = types.SimpleNamespace(max_new_tokens=24, dynamic_draft_top_k=4,
                                              dynamic_draft_all_top_k=10, dynamic_draft_max_depth=4)
    model.prepare_inference(inference_configs)

    input_ids = torch.randint(0, config.vocab_size, (1, 9))
    attention_mask = torch.ones_like(input_ids)

    state = {"seq": input_ids[0].tolist(), "nodes": 0, "caches": 0}

    # checks wrapped around the project's verify / reset_kv_cache
    def checked_verify(self, base_kv, position_embeddings, past_seq_len, idx_B, **draft_outputs):
        captured = {}
        hook = self.base_model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("h", o))
        out = EagleV2.verify(self, base_kv, position_embeddings, past_seq_len, idx_B, **draft_outputs)
        hook.remove()
        tree_logits = self.get_token_logits(captured["h"])[0]
        buff, tree_mask = draft_outputs["draft_token_buff"][0], draft_outputs["tree_mask"][0]
        assert past_seq_len == len(state["seq"]) - 1 and buff[0].item() == state["seq"][-1]
        for node in range(tree_mask.shape[0]):
            path = tree_mask[node].nonzero().flatten()  # ancestors have lower rows: root .. node
            ids = torch.tensor([state["seq"] + buff[path[1:]].tolist()])
            ref = self(input_ids=ids).logits[0, -1]
            torch.testing.assert_close(tree_logits[node], ref, rtol=1e-9, atol=1e-9)
            state["nodes"] += 1
        state["buff"] = buff.clone()
        return out

    def checked_reset(self, base_kv, draft_kv, past_seq_len, indices):
        EagleV2.reset_kv_cache(self, base_kv, draft_kv, past_seq_len, indices)
        kept = state["seq"][:-1] + state["buff"][indices[0]].tolist()
        ref_kv = DynamicCache()
        self(input_ids=torch.tensor([kept]), use_cache=True, cache=ref_kv)
        for layer, ref_layer in zip(base_kv.layers, ref_kv.layers):
            torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(layer.values, ref_layer.values, rtol=1e-9, atol=1e-9)
        state["caches"] += 1

    model.verify = types.MethodType(checked_verify, model)
    model.reset_kv_cache = types.MethodType(checked_reset, model)

    accept_lengths = []
    with torch.no_grad():
        generated = []
        for i, tokens in enumerate(model.speculative_generate(input_ids, attention_mask)):
            new = tokens[0].tolist()
            if i > 0:
                accept_lengths.append(len(new))
            generated += new
            state["seq"] += new
            if len(generated) >= inference_configs.max_new_tokens:
                break
        expected = plain_greedy(model, input_ids, len(generated))

    assert generated == expected, (generated, expected)
    assert max(accept_lengths) > 1, accept_lengths
    print(f"generated {len(generated)} tokens in {len(accept_lengths)} verify steps, "
          f"accept lengths {accept_lengths}")
    print(f"{state['nodes']} tree nodes matched plain causal runs; {state['caches']} shrunk caches matched "
          f"fresh prefills; tokens equal plain greedy decoding")


if __name__ == "__main__":
    main()
