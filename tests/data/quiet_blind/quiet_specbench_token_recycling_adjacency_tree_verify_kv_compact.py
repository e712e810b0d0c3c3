"""Correct program (quiet batch quiet-r92a).

Citation: hemingkx/Spec-Bench evaluation/inference_recycling.py @6d56ad244a33674f6138b35a38fe3706166104a9
(recycling_forward: prepare_data builds candi_attention_ids / candi_positon_ids / search_path from the tree
template, prepare_data_input_ids fills the tree from the adjacency matrix, merge_attention_mask = cat(ones over the
verified prefix, tree mask) passed as a 4D 0/1 mask, merge_positon_ids = depth + prefix length, greedy path reward,
past_key_values_data copy of the accepted path and current_length_data.fill_), model/recycling/modeling_llama_kv.py
@6d56ad244a33674f6138b35a38fe3706166104a9 (LlamaModel.forward hands the 4D mask to transformers 4.37
_prepare_4d_causal_attention_mask, which inverts it into an additive finfo.min mask).

Token Recycling (training-free tree speculative decoding), batch 1: the root is the last accepted token, its
descendants come from an adjacency matrix of recycled top-k tokens; the tree is verified in one forward over the KV
cache of the verified prefix, and the accepted path's K/V rows are copied down behind the prefix. Ported to a tiny
transformers LlamaForCausalLM with a DynamicCache (the copy goes into each layer's keys/values, trimming the rest,
instead of a preallocated buffer plus a length counter). Self-check: every tree node's logits equal a cache-free run
of prefix + its root-to-node path, and the generated text equals plain greedy decoding.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

OUTPUT_ID_TOPK = 4
# tree template as in model/recycling/tree_template_.py: each entry is a path of top-k ranks from the root
TREE_TEMPLATE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]


def invert_4d_mask(mask, dtype):
    # transformers 4.37 AttentionMaskConverter path for a custom 4D mask of 1 (keep) / 0 (drop)
    inverted_mask = 1.0 - mask.to(dtype)
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


@torch.no_grad()
def recycling_forward(input_ids, model, adj_matrix, max_new_tokens, eos_token_id, output_id_topk=OUTPUT_ID_TOPK,
                      tree_template=TREE_TEMPLATE, trace=None):
    accept_length_list = []
    step = 0
    start_len = input_ids.size(1)
    verify_input_ids = input_ids[:, :-1]
    input_ids = input_ids[:, -1:]

    past_key_values = DynamicCache(config=model.config)
    model(input_ids=verify_input_ids, past_key_values=past_key_values, use_cache=True)

    pad_len = len(tree_template[-1]) + 1

    def prepare_data(template, input_ids):
        candi_attention_ids = torch.zeros([input_ids.size(0), len(template) + 1, len(template) + 1], dtype=torch.long)
        candi_positon_ids = torch.zeros([input_ids.size(0), len(template) + 1], dtype=torch.long)
        candi_attention_ids[:, :, 0] = 1
        candi_positon_ids[:, 0] = 0
        search_path = []
        father_index = [-1]
        candi_index = [-1]
        deep_split = []
        for candi_i in range(len(template)):
            tree_deep = len(template[candi_i])
            tree_index = template[candi_i][-1]
            if tree_deep == 1:
                father_index.append(0)
            else:
                father_index.append(template.index(template[candi_i][:-1]) + 1)
            candi_index.append(tree_index)
            candi_positon_ids[:, candi_i + 1] = tree_deep
            if tree_deep != candi_positon_ids[:, candi_i]:
                deep_split.append(candi_i + 1)
            cur_path = [0]
            candi_attention_ids[:, candi_i + 1, candi_i + 1] = 1
            for candi_j in range(candi_i):
                if template[candi_j] == template[candi_i][:len(template[candi_j])]:
                    candi_attention_ids[:, candi_i + 1, candi_j + 1] = 1
                    cur_path.append(candi_j + 1)
            cur_path.append(candi_i + 1)
            for sub_i in range(1, len(cur_path)):
                if cur_path[:sub_i] in search_path:
                    search_path.remove(cur_path[:sub_i])
            search_path.append(cur_path)
        deep_split.append(len(template) + 1)
        search_path = torch.tensor([path + [-1] * (pad_len - len(path)) for path in search_path], dtype=torch.long)
        father_index = torch.tensor(father_index, dtype=torch.long)
        candi_index = torch.tensor(candi_index, dtype=torch.long)
        return candi_attention_ids, candi_positon_ids, search_path, father_index, candi_index, deep_split

    def prepare_data_input_ids(cur_input_ids, adj_matrix, father_index, candi_index, deep_split):
        input_ids = torch.zeros_like(father_index, dtype=torch.long)
        input_ids[0] = cur_input_ids
        for layer in range(len(deep_split) - 1):
            cur_father = input_ids[father_index[deep_split[layer]:deep_split[layer + 1]]]
            cur_father_index = cur_father * output_id_topk + candi_index[deep_split[layer]:deep_split[layer + 1]]
            input_ids[deep_split[layer]:deep_split[layer + 1]] = adj_matrix.view(-1)[cur_father_index]
        return input_ids.unsqueeze(0)

    attention_mask, position_ids, search_path, father_index, candi_index, deep_split = prepare_data(tree_template, input_ids)

    for i in range(max_new_tokens):
        input_ids = prepare_data_input_ids(input_ids, adj_matrix, father_index, candi_index, deep_split)
        merge_attention_mask = torch.cat([torch.ones([input_ids.size(0), len(tree_template) + 1, verify_input_ids.size(1)], dtype=torch.long), attention_mask], dim=-1)
        merge_positon_ids = position_ids + verify_input_ids.size(1)

        outputs = model(input_ids=input_ids, attention_mask=invert_4d_mask(merge_attention_mask.unsqueeze(1), torch.float32),
                        position_ids=merge_positon_ids, past_key_values=past_key_values, use_cache=True)
        if trace is not None:
            trace.append((verify_input_ids.clone(), input_ids.clone(), attention_mask.clone(), outputs.logits.clone()))

        model_res = torch.argmax(outputs.logits, dim=-1)
        all_input_path = input_ids[0][search_path]
        all_input_path[search_path == -1] = -100
        all_output_path = model_res[0][search_path]
        reward = torch.cumprod(all_input_path[:, 1:].eq(all_output_path[:, :-1]), dim=-1).sum(dim=-1)
        best_reward = reward.max()

        accept_len = 1 + best_reward
        accept_length_list.append(accept_len.item())
        best_path_index = torch.argmax(reward, dim=-1).to(torch.long)
        index_path = search_path[best_path_index][:accept_len]
        best_path_input = torch.index_select(input_ids, index=index_path, dim=1)

        # past_key_values_data[..., L + index_path, :] copied to [L, L + accept_len), current_length = L + accept_len
        L = verify_input_ids.size(1)
        for layer in past_key_values.layers:
            layer.keys = torch.cat([layer.keys[..., :L, :], layer.keys[..., L + index_path, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :L, :], layer.values[..., L + index_path, :]], dim=-2)

        verify_input_ids = torch.cat([verify_input_ids, best_path_input], dim=-1)

        if (best_path_input == eos_token_id).any() or verify_input_ids.size(1) - start_len > max_new_tokens:
            break

        to_update = torch.topk(outputs.logits, k=output_id_topk, dim=-1)[1][0]
        adj_matrix[input_ids.squeeze(0)] = to_update

        input_ids = model_res[:, search_path[best_path_index][accept_len - 1]].unsqueeze(-1)
        if (input_ids == eos_token_id).any():
            start_len -= 1
            break
        step += 1
    return verify_input_ids, verify_input_ids.size(1) - start_len, step, accept_length_list


def main():
    torch.manual_seed(0)
    vocab = 24
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    eos = -1  # no eos in this run: generate the full budget

    prompt = torch.tensor([[1, 5, 9, 3, 17, 11, 6, 5, 9]])
    adj_matrix = torch.zeros((vocab, OUTPUT_ID_TOPK), dtype=torch.long)
    trace = []
    out, new_tokens, steps, accepts = recycling_forward(prompt, model, adj_matrix, 30, eos, trace=trace)
    assert max(accepts) > 1, accepts  # some tree paths were accepted past the root

    with torch.no_grad():
        # reference 1: each tree node's logits from a cache-free run of prefix + its root-to-node path
        for verified, tree_ids, tree_mask, logits in trace:
            T = tree_ids.shape[1]
            for node in range(T):
                path = [j for j in range(T) if tree_mask[0, node, j] == 1]
                seq = torch.cat([verified, tree_ids[:, path]], dim=1)
                ref = model(seq, use_cache=False).logits[:, -1]
                torch.testing.assert_close(logits[:, node], ref, atol=1e-4, rtol=1e-4)
        # reference 2: plain greedy decoding, one token at a time, no cache
        seq = prompt.clone()
        while seq.shape[1] < out.shape[1]:
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        # out holds prompt[:-1] + accepted paths that start from the prompt's last token
        assert torch.equal(out, seq), (out, seq)
    print("ok", out.shape[1], "tokens in", len(accepts), "verify steps, accepted", accepts)


if __name__ == "__main__":
    main()
