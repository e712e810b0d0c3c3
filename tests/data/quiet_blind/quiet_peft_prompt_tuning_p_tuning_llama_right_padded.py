"""PEFT prompt tuning and P-tuning on a causal LM: learned virtual tokens prepended to the input embeddings,
the attention mask extended with ones for them, their labels set to -100; a right-padded batch.

Ported from huggingface/peft @91685f524b3e783585679fc03744dc4ae30cad12 src/peft/peft_model.py
(PeftModel._setup_prompt_encoder: prompt_tokens = arange(num_virtual_tokens), word_embeddings found by vocab size;
PeftModel.get_prompt: `prompt_encoder(prompt_tokens)` for PROMPT_TUNING / P_TUNING;
PeftModelForCausalLM.forward: `prefix_attention_mask = torch.ones(batch_size, num_virtual_tokens)` cat'ed before
attention_mask, position_ids dropped, `prefix_labels = torch.full(..., -100)` cat'ed before labels,
inputs_embeds = cat(prompts, word_embeddings(input_ids))), src/peft/tuners/prompt_tuning/model.py (PromptEmbedding,
RANDOM init) and src/peft/tuners/p_tuning/model.py @628ad7c0cdd7bb6c6dae1133c020932fe3440d00 (PromptEncoder, MLP
reparameterization).  The base model is transformers' LlamaForCausalLM built from a tiny LlamaConfig (installed
transformers), run with the eager and the SDPA attention; peft itself is not installed, its code is written out.

Since peft drops position_ids, the batch is right-padded (as its causal-LM examples pad), so every real token keeps
the position it has alone.  Checked against each example run alone: [virtual tokens | its own tokens], no padding,
no attention mask (the model's own causal mask), logits at every real position and the batch loss.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)


class PromptEmbedding(nn.Module):
    """peft PromptEmbedding (prompt_tuning_init=RANDOM)."""

    def __init__(self, config, word_embeddings):
        super().__init__()
        total_virtual_tokens = config["num_virtual_tokens"] * config["num_transformer_submodules"]
        self.embedding = nn.Embedding(total_virtual_tokens, config["token_dim"])

    def forward(self, indices):
        return self.embedding(indices)


class PromptEncoder(nn.Module):
    """peft PromptEncoder, encoder_reparameterization_type=MLP."""

    def __init__(self, config):
        super().__init__()
        self.token_dim = config["token_dim"]
        self.hidden_size = config["encoder_hidden_size"]
        self.total_virtual_tokens = config["num_virtual_tokens"] * config["num_transformer_submodules"]
        self.embedding = nn.Embedding(self.total_virtual_tokens, self.token_dim)
        self.mlp_head = nn.Sequential(
            nn.Linear(self.token_dim, self.hidden_size), nn.ReLU(),
            nn.Linear(self.hidden_size, self.hidden_size), nn.ReLU(),
            nn.Linear(self.hidden_size, self.token_dim),
        )

    def forward(self, indices):
        return self.mlp_head(self.embedding(indices))


class PeftModelForCausalLM(nn.Module):
    def __init__(self, model, peft_config):
        super().__init__()
        self.base_model = model
        self.peft_config = peft_config
        for p in self.base_model.parameters():
            p.requires_grad = False
        for named_param, value in list(self.base_model.named_parameters()):
            if value.shape[0] == self.base_model.config.vocab_size:
                self.word_embeddings = self.base_model.get_submodule(named_param.replace(".weight", ""))
                break
        if peft_config["peft_type"] == "PROMPT_TUNING":
            self.prompt_encoder = PromptEmbedding(peft_config, self.word_embeddings)
        elif peft_config["peft_type"] == "P_TUNING":
            self.prompt_encoder = PromptEncoder(peft_config)
        self.prompt_tokens = torch.arange(
            peft_config["num_virtual_tokens"] * peft_config["num_transformer_submodules"]).long()

    def get_prompt(self, batch_size):
        prompt_tokens = self.prompt_tokens.unsqueeze(0).expand(batch_size, -1)
        return self.prompt_encoder(prompt_tokens)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        peft_config = self.peft_config
        batch_size = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
        if attention_mask is not None:
            # concat prompt attention mask
            prefix_attention_mask = torch.ones(batch_size, peft_config["num_virtual_tokens"]).to(attention_mask.device)
            attention_mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)
        if kwargs.get("position_ids", None) is not None:
            kwargs["position_ids"] = None
        kwargs.update({"attention_mask": attention_mask, "labels": labels})
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        # concat prompt labels
        if labels is not None:
            prefix_labels = torch.full((batch_size, peft_config["num_virtual_tokens"]), -100).to(labels.device)
            kwargs["labels"] = torch.cat((prefix_labels, labels), dim=1)
        prompts = self.get_prompt(batch_size=batch_size)
        prompts = prompts.to(inputs_embeds.dtype)
        inputs_embeds = torch.cat((prompts, inputs_embeds), dim=1)
        return self.base_model(inputs_embeds=inputs_embeds, **kwargs)


def collate_right_padded(examples, pad_id):
    """Prompt + target, labels -100 on the prompt, right padding with pad_id / mask 0 / label -100."""
    L = max(len(p) + len(t) for p, t in examples)
    ids, mask, labels = [], [], []
    for p, t in examples:
        seq = p + t
        d = L - len(seq)
        ids.append(seq + [pad_id] * d)
        mask.append([1] * len(seq) + [0] * d)
        labels.append([-100] * len(p) + t + [-100] * d)
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def main():
    examples = [([3, 17, 8, 21], [30, 5, 2]), ([9, 4], [11, 2]), ([6, 25, 14, 19, 7], [28, 2])]
    pad_id = 0
    ids, mask, labels = collate_right_padded(examples, pad_id)
    ok = True
    for attn in ("eager", "sdpa"):
        for peft_type in ("PROMPT_TUNING", "P_TUNING"):
            torch.manual_seed(1)
            cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              pad_token_id=pad_id, bos_token_id=1, eos_token_id=2)
            cfg._attn_implementation = attn
            base = LlamaForCausalLM(cfg).eval()
            peft_config = {"peft_type": peft_type, "num_virtual_tokens": 4, "num_transformer_submodules": 1,
                           "token_dim": 32, "encoder_hidden_size": 24}
            model = PeftModelForCausalLM(base, peft_config).eval()
            P = peft_config["num_virtual_tokens"]
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
                prompts = model.get_prompt(1)
                tot, cnt = 0.0, 0
                for b, (p, t) in enumerate(examples):
                    seq = torch.tensor([p + t])
                    alone = base(inputs_embeds=torch.cat((prompts, model.word_embeddings(seq)), 1)).logits[0]
                    n = P + len(p) + len(t)
                    m = torch.allclose(out.logits[b, :n], alone, atol=1e-5, rtol=1e-4)
                    ok &= m
                    print(f"{attn:5s} {peft_type:13s} row {b}: logits match={m}")
                    # loss over the target tokens only (prompt, virtual tokens and padding are -100)
                    tgt = torch.tensor(t)
                    pred = alone[P + len(p) - 1: n - 1]
                    tot += F.cross_entropy(pred, tgt, reduction="sum").item()
                    cnt += len(t)
                m = abs(out.loss.item() - tot / cnt) < 1e-5
                ok &= m
                print(f"{attn:5s} {peft_type:13s} loss {out.loss.item():.6f} vs alone {tot / cnt:.6f}: match={m}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
