# Correct program (quiet batch quiet-r145a).
# Ported from XiangLi1999/PrefixTuning @48dbaff350752d130501e1ee63a8e0c20c62868f, gpt2/train_control.py
# (PrefixTuning: input_tokens / wte / control_trans, get_prompt_p5, forward passing the prompt as GPT-2's
# past_key_values), shrunk to a tiny GPT2LMHeadModel built from GPT2Config (transformers 5: the per-layer
# (2, bsz, n_head, preseqlen, head_dim) prompt is loaded into a DynamicCache layer by layer).
# Li & Liang's prefix-tuning: preseqlen virtual key/value vectors, made by an MLP from a small embedding, are
# prepended to every layer's cache; the frozen GPT-2 reads them as past.  The batch is left-padded, so the
# attention_mask is extended by preseqlen ones on its left (the prefix is always visible), position_ids come from
# the extended mask's cumsum (as transformers' generate makes them), and a greedy decode loop appends one column of
# ones per step.  Every row's prefill logits, step logits and generated
# tokens are checked against the row run alone, unpadded, re-run without a kept cache at every step.
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.cache_utils import DynamicCache

torch.manual_seed(0)


class PrefixTuning(nn.Module):
    def __init__(self, config, preseqlen=5, mid_dim=48, prefix_dropout=0.0):
        super().__init__()
        self.match_n_layer = config.n_layer
        self.match_n_head = config.n_head
        self.match_n_embd = config.n_embd // config.n_head
        self.n_embd = config.n_embd
        self.preseqlen = preseqlen
        self.mid_dim = mid_dim
        # [Full prefix-tuning Setting]
        self.input_tokens = torch.arange(self.preseqlen).long()
        self.wte = nn.Embedding(self.preseqlen, config.n_embd)
        self.control_trans = nn.Sequential(
            nn.Linear(config.n_embd, self.mid_dim),
            nn.Tanh(),
            nn.Linear(self.mid_dim, config.n_layer * 2 * config.n_embd))
        self.dropout = nn.Dropout(prefix_dropout)
        self.get_prompt = self.get_prompt_p5

    def get_prompt_p5(self, control_code=None, gpt2=None, bsz=None):
        input_tokens = self.input_tokens.unsqueeze(0).expand(bsz, -1).to(self.wte.weight.device)
        temp_control = self.wte(input_tokens)
        past_key_values = self.control_trans(temp_control)  # bsz, seqlen, layer*emb
        bsz, seqlen, _ = past_key_values.shape
        past_key_values = past_key_values.view(bsz, seqlen, self.match_n_layer * 2, self.match_n_head,
                                               self.match_n_embd)
        past_key_values = self.dropout(past_key_values)
        past_key_values = past_key_values.permute([2, 0, 3, 1, 4]).split(2)
        # transformers 5 takes a Cache object rather than the legacy per-layer (key, value) stack
        cache = DynamicCache()
        for layer_idx, kv in enumerate(past_key_values):
            cache.update(kv[0].contiguous(), kv[1].contiguous(), layer_idx)
        return cache

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, gpt2_model=None, use_cache=True,
                **kwargs):
        bsz = input_ids.shape[0]
        past_key_values = self.get_prompt(None, gpt2=gpt2_model, bsz=bsz)
        return gpt2_model(input_ids=input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=use_cache, return_dict=True, **kwargs)


def generate(prefix_model, gpt2, input_ids, attention_mask, max_new_tokens):
    """Greedy batch generation from a left-padded prompt batch with the prefix in every layer's cache."""
    bsz = input_ids.shape[0]
    # the virtual tokens are always attended: extend the mask by preseqlen ones on the left
    prefix_attn = torch.ones(bsz, prefix_model.preseqlen, dtype=attention_mask.dtype)
    attention_mask = torch.cat([prefix_attn, attention_mask], dim=1)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    position_ids = position_ids[:, -input_ids.shape[1]:]
    out = prefix_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       gpt2_model=gpt2)
    past = out.past_key_values
    step_logits, tokens = [], []
    next_logits = out.logits[:, -1, :]
    for _ in range(max_new_tokens):
        step_logits.append(next_logits)
        next_tok = next_logits.argmax(-1, keepdim=True)
        tokens.append(next_tok)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(bsz, 1)], dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = gpt2(input_ids=next_tok, past_key_values=past, attention_mask=attention_mask,
                   position_ids=position_ids, use_cache=True, return_dict=True)
        past = out.past_key_values
        next_logits = out.logits[:, -1, :]
    return torch.stack(step_logits, 1), torch.cat(tokens, 1)


def main():
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=3, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                        bos_token_id=1, eos_token_id=1, initializer_range=0.2, attn_implementation="eager")
    gpt2 = GPT2LMHeadModel(config).double().eval()
    for p in gpt2.parameters():  # frozen LM, only the prefix is trained
        p.requires_grad_(False)
    prefix_model = PrefixTuning(config, preseqlen=5).double().eval()

    pad_id = config.pad_token_id
    lens = [7, 3, 5, 1]
    prompts = [torch.randint(1, config.vocab_size, (n,)) for n in lens]
    T = max(lens)
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding, as for batched generation with GPT-2
        input_ids[b, T - len(p):] = p
        attention_mask[b, T - len(p):] = 1

    new_tokens = 6
    with torch.no_grad():
        # prefill logits of the padded batch, for the real prompt positions
        bsz = input_ids.shape[0]
        ext = torch.cat([torch.ones(bsz, prefix_model.preseqlen, dtype=torch.long), attention_mask], 1)
        pos = (ext.cumsum(-1) - 1).masked_fill(ext == 0, 1)[:, -T:]
        prefill = prefix_model(input_ids=input_ids, attention_mask=ext, position_ids=pos, gpt2_model=gpt2).logits
        batch_logits, batch_tokens = generate(prefix_model, gpt2, input_ids, attention_mask, new_tokens)

        worst = 0.0
        for b, p in enumerate(prompts):
            one = p[None]
            ref_prefill = prefix_model(input_ids=one, gpt2_model=gpt2).logits  # positions default to preseqlen..
            worst = max(worst, (prefill[b, T - len(p):] - ref_prefill[0]).abs().max().item())
            # reference decode: the row alone, no padding, no cache kept between steps (the prompt and the
            # tokens so far re-run each step behind a fresh prefix)
            seq = p.clone()
            for t in range(new_tokens):
                ref_step = prefix_model(input_ids=seq[None], gpt2_model=gpt2).logits[0, -1]
                worst = max(worst, (batch_logits[b, t] - ref_step).abs().max().item())
                seq = torch.cat([seq, ref_step.argmax(-1, keepdim=True)])
            assert torch.equal(batch_tokens[b], seq[len(p):]), (b, batch_tokens[b], seq[len(p):])

    print("generated:", batch_tokens.tolist())
    print("max |batch - per-row| logit diff: %.3g" % worst)
    assert worst < 1e-9, worst
    print("ok")


if __name__ == "__main__":
    main()
