"""DeepSpeed-Chat step-2 reward model: pairwise loss from the divergence to the later end.

Follows deepspeedai/DeepSpeedExamples, applications/DeepSpeed-Chat/dschat/utils/model/
reward_model.py, RewardModel.forward (and forward_value's end-score read), on an OPT
backbone (create_hf_model(AutoModel, ...) with OPT in the step-2 scripts), data from
dschat/utils/data/data_utils.py (chosen and rejected sentences each end with the
end-of-conversation token and are padded="max_length" on the RIGHT with pad_token_id;
the batch is [all chosen; all rejected]). Here num_padding_at_beginning = 0 (the
scripts' setting for tokenizers that put no pad token first; OPT's default is 1), and
the backbone uses sdpa, the transformers default.

Per pair:
  c_ind = index of the first pad of chosen (seq_len if none), r_ind likewise
  divergence_ind = first index where chosen and rejected token ids differ
  end_ind = max(c_ind, r_ind)
  loss += -logsigmoid(chosen_reward[div:end] - rejected_reward[div:end]).mean()
  chosen_mean_scores = chosen_reward[c_ind - 1]   (the last REAL token)
So the loss deliberately reads, for the shorter side of a pair, the rewards of its
pad positions up to the longer side's end: those rows are causal hidden states whose
keys are only the real tokens (the pads are masked as keys), i.e. a fixed function of
that sequence alone, and the project trains on them as "the reward after the end".
Check: the batch padded to max_seq_len gives the same losses and scores as each pair
padded only to its own longer length, and the end scores equal each sequence run
alone without any padding.
"""
import torch
from transformers import OPTConfig, OPTModel

torch.manual_seed(0)
DT = torch.float64
PAD, EOC, MAX_LEN = 1, 2, 14


def reward_forward(model, v_head, input_ids, attention_mask):
    h = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]
    rewards = v_head(h).squeeze(-1)
    bs, seq_len = input_ids.shape[0] // 2, input_ids.shape[1]
    chosen_ids, rejected_ids = input_ids[:bs], input_ids[bs:]
    chosen_rewards, rejected_rewards = rewards[:bs], rewards[bs:]
    losses, c_scores, r_scores = [], [], []
    for i in range(bs):
        chosen_id, rejected_id = chosen_ids[i], rejected_ids[i]
        chosen_reward, rejected_reward = chosen_rewards[i], rejected_rewards[i]
        c_inds = (chosen_id == PAD).nonzero()
        c_ind = c_inds[0].item() if len(c_inds) > 0 else seq_len   # num_padding_at_beginning = 0
        check_divergence = (chosen_id != rejected_id).nonzero()
        if len(check_divergence) == 0:
            end_ind = rejected_reward.size(-1)
            divergence_ind = end_ind - 1
            r_ind = c_ind
        else:
            r_inds = (rejected_id == PAD).nonzero()
            r_ind = r_inds[0].item() if len(r_inds) > 0 else seq_len
            end_ind = max(c_ind, r_ind)
            divergence_ind = check_divergence[0].item()
        assert divergence_ind > 0
        c_trunc = chosen_reward[divergence_ind:end_ind]
        r_trunc = rejected_reward[divergence_ind:end_ind]
        c_scores.append(chosen_reward[c_ind - 1])
        r_scores.append(rejected_reward[r_ind - 1])
        losses.append(-torch.nn.functional.logsigmoid(c_trunc - r_trunc).mean())
    return torch.stack(losses), torch.stack(c_scores), torch.stack(r_scores)


def pad_batch(seqs, length):
    ids = torch.tensor([s + [PAD] * (length - len(s)) for s in seqs])
    return ids, (ids != PAD).long()


def main():
    cfg = OPTConfig(vocab_size=40, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=PAD,
                    enable_bias=True, dropout=0.0, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    model = OPTModel(cfg).to(DT).eval()
    v_head = torch.nn.Linear(32, 1, bias=False).to(DT)

    prompts = [[2, 7, 9, 11], [2, 5, 6], [2, 30, 31, 32, 33]]
    chosen = [p + r + [EOC] for p, r in zip(prompts, [[12, 13, 14, 15], [8], [20, 21]])]
    rejected = [p + r + [EOC] for p, r in zip(prompts, [[16, 17], [18, 19, 22, 23, 24], [25, 26]])]

    with torch.no_grad():
        ids, mask = pad_batch(chosen + rejected, MAX_LEN)
        loss, c_s, r_s = reward_forward(model, v_head, ids, mask)

        worst = 0.0
        for i in range(len(prompts)):  # each pair alone, padded only to its longer side
            L = max(len(chosen[i]), len(rejected[i]))
            pid, pmask = pad_batch([chosen[i], rejected[i]], L)
            l1, c1, r1 = reward_forward(model, v_head, pid, pmask)
            worst = max(worst, (l1 - loss[i]).abs().max().item(), (c1 - c_s[i]).abs().max().item(),
                        (r1 - r_s[i]).abs().max().item())
            for seq, score in ((chosen[i], c_s[i]), (rejected[i], r_s[i])):  # alone, unpadded
                h = model(input_ids=torch.tensor([seq]), use_cache=False)[0]
                worst = max(worst, (v_head(h)[0, -1, 0] - score).abs().item())
    print("pair losses:", [round(x, 6) for x in loss.tolist()])
    print("chosen end scores:", [round(x, 6) for x in c_s.tolist()])
    print(f"max|batch padded to {MAX_LEN} - pair alone / sequence alone| = {worst:.2e}")
    assert worst < 1e-10, worst
    print("ok")


if __name__ == "__main__":
    main()
