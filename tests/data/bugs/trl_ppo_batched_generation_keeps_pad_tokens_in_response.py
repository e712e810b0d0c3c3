# huggingface/trl#487: PPOTrainer._generate_batched returned responses still carrying the pad (= eos) tokens that
# batched generation appends after a sequence finished; prepare_model_inputs then gives them attention_mask 1.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)
VOCAB, DIM, HEADS, LAYERS = 30, 32, 4, 2
EOS_TOKEN_ID = PAD_TOKEN_ID = 1  # gpt2: tokenizer.pad_token = tokenizer.eos_token


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, attention_mask):
        B, T, _ = x.shape
        blocked = torch.ones(T, T, dtype=torch.bool).triu(1)[None] | (attention_mask == 0)[:, None, :]
        attn_mask = torch.zeros(B, T, T).masked_fill(blocked, torch.finfo(torch.float32).min)
        attn_mask = attn_mask.repeat_interleave(HEADS, dim=0)
        h = self.ln_1(x)
        a, _ = self.attn(h, h, h, attn_mask=attn_mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln_2(x))


class AutoModelForCausalLMWithValueHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head, self.v_head = nn.Linear(DIM, VOCAB), nn.Linear(DIM, 1)

    def forward(self, input_ids, attention_mask):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.wte(input_ids) + self.wpe(position_ids)
        for blk in self.h:
            x = blk(x, attention_mask)
        return self.lm_head(x), None, self.v_head(x).squeeze(-1)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        for _ in range(max_new_tokens):
            logits = self(input_ids, attention_mask)[0][:, -1]
            nxt = torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]
            nxt = torch.where(done, torch.full_like(nxt, PAD_TOKEN_ID), nxt)
            done |= nxt == EOS_TOKEN_ID
            input_ids = torch.cat([input_ids, nxt[:, None]], 1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(nxt[:, None])], 1)
        return input_ids


def left_pad(seqs):
    width = max(len(s) for s in seqs)
    ids = torch.stack([torch.cat([torch.full((width - len(s),), PAD_TOKEN_ID), s]) for s in seqs])
    mask = torch.stack([torch.cat([torch.zeros(width - len(s), dtype=torch.long), torch.ones_like(s)]) for s in seqs])
    return {"input_ids": ids, "attention_mask": mask}


def _generate_batched(model, query_tensors, remove_padding, **generation_kwargs):
    padded_inputs = left_pad(query_tensors)
    generations = model.generate(**padded_inputs, **generation_kwargs)
    outputs = []
    for generation, mask in zip(generations, padded_inputs["attention_mask"]):
        output = generation[(1 - mask).sum():]  # remove padding
        output = output[mask.sum():]  # remove prompt (return_prompt=False)
        if remove_padding and EOS_TOKEN_ID in output:
            pad_start = torch.nonzero(output == EOS_TOKEN_ID, as_tuple=False)[0, 0].item()
            output = output[: pad_start + 1]  # keep the eos token at the end
        outputs.append(output)
    return outputs


def prepare_model_inputs(queries, responses):
    input_ids = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    width = max(len(i) for i in input_ids)  # data_collator pads on the right
    ids = torch.stack([torch.cat([i, torch.full((width - len(i),), PAD_TOKEN_ID)]) for i in input_ids])
    mask = torch.stack([torch.cat([torch.ones_like(i), torch.zeros(width - len(i), dtype=torch.long)])
                        for i in input_ids])
    return {"input_ids": ids, "attention_mask": mask}


model = AutoModelForCausalLMWithValueHead().eval()
with torch.no_grad():
    model.lm_head.bias[EOS_TOKEN_ID] += 1.2  # make some samples finish early
queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])]
responses = _generate_batched(model, queries, remove_padding=FIXED, max_new_tokens=6)

# PPOTrainer.step -> batched_forward_pass
inputs = prepare_model_inputs(queries, responses)
with torch.no_grad():
    logits, _, values = model(**inputs)
logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
for j, (q, r) in enumerate(zip(queries, responses)):
    start, end = len(q) - 1, len(q) - 1 + len(r)
    print(f"fixed={FIXED} sample {j}: response={r.tolist()} attention_mask={inputs['attention_mask'][j].tolist()}")
    print(f"  response logprob sum={logprobs[j, start:end].sum().item():.4f} last value={values[j, end].item():.4f}")
