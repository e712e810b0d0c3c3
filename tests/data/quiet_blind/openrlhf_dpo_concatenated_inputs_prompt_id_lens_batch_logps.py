# Follows OpenRLHF: openrlhf/trainer/dpo_trainer.py DPOTrainer.concatenated_inputs (pad chosen/rejected groups to one
# length, attention mask padded with 0) and _get_batch_logps (loss mask = attention mask with the first prompt_id_len
# tokens cleared); the Actor derives position_ids from attention_mask.cumsum. Pads are keys nobody sees.
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(10)
cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, attn_implementation="eager")
model = LlamaForCausalLM(cfg).double().eval()
PAD = 0

prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
chosen_resp = [[13, 14, 15, 16, 2], [17, 2]]
reject_resp = [[18, 2], [19, 20, 21, 22, 23, 24, 2]]

def right_pad(seqs):   # per-group collate: right padding
    L = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (L - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    return ids, mask

chosen_ids, c_mask = right_pad([p + r for p, r in zip(prompts, chosen_resp)])
reject_ids, r_mask = right_pad([p + r for p, r in zip(prompts, reject_resp)])
prompt_id_lens = [len(p) for p in prompts]

def concatenated_inputs(chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens):
    def pad_to_length(tensor, length, pad_value, dim=-1):
        if tensor.size(dim) >= length:
            return tensor
        pad_size = list(tensor.shape); pad_size[dim] = length - tensor.size(dim)
        return torch.cat([tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype)], dim=dim)
    max_length = max(chosen_ids.shape[1], reject_ids.shape[1])
    inputs_ids = torch.cat((pad_to_length(chosen_ids, max_length, PAD), pad_to_length(reject_ids, max_length, PAD)), dim=0)
    max_length = max(c_mask.shape[1], r_mask.shape[1])
    att_masks = torch.cat((pad_to_length(c_mask, max_length, 0), pad_to_length(r_mask, max_length, 0)), dim=0)
    return inputs_ids, att_masks, prompt_id_lens * 2

def actor_logits(input_ids, attention_mask):
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    return model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits

def _get_batch_logps(logits, labels, attention_mask, prompt_id_lens):
    labels = labels[:, 1:].clone(); logits = logits[:, :-1, :]
    loss_masks = attention_mask.clone().bool()
    for mask, source_len in zip(loss_masks, prompt_id_lens):
        mask[:source_len] = False
    loss_masks = loss_masks[:, 1:]
    labels[loss_masks == False] = 0
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token_logps * loss_masks).sum(-1)

with torch.no_grad():
    ids, am, pl = concatenated_inputs(chosen_ids, c_mask, reject_ids, r_mask, prompt_id_lens)
    all_logps = _get_batch_logps(actor_logits(ids, am), ids, am, pl)

    # reference: every sequence alone, unpadded, no mask; response log-probs summed with an explicit loop
    ref = []
    for p, resp in list(zip(prompts, chosen_resp)) + list(zip(prompts, reject_resp)):
        seq = torch.tensor([p + resp])
        lp = model(seq).logits[0].log_softmax(-1)
        ref.append(sum(lp[t - 1, seq[0, t]] for t in range(len(p), seq.shape[1])))
    ref = torch.stack(ref)
diff = (all_logps - ref).abs().max().item()
print("logps", [round(v, 4) for v in all_logps.tolist()], "max diff", diff)
assert diff < 1e-10
