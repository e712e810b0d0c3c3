# areal-project/AReaL#1442 (fix proposed in #1558): the FSDP engine packs several sequences into one row and, for
# model types outside a small allowlist, injects attention_mask=dict(full_attention=None, sliding_attention=None);
# the HF model then skips mask creation, so with attn_impl=sdpa/eager each sequence attends to the ones packed before it.
import sys

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def is_qwen3_moe_model(model_type):
    return model_type in ["qwen3_moe"]


def pack_tensor_dict(seqs):
    """Concatenate variable-length sequences into one row, with reset position_ids and cu_seqlens."""
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    cu_seqlens = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    input_ids = torch.cat([torch.tensor(s) for s in seqs])
    position_ids = torch.cat([torch.arange(n) for n in lens.tolist()])
    return dict(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=int(lens.max()))


def pad_mb(mb, multiple=8):
    pad = (-mb["input_ids"].numel()) % multiple
    if pad:
        mb["input_ids"] = F.pad(mb["input_ids"], (0, pad), value=0)
        mb["position_ids"] = torch.cat([mb["position_ids"], torch.arange(pad)])
        mb["cu_seqlens"] = torch.cat([mb["cu_seqlens"], mb["cu_seqlens"][-1:] + pad])
    return mb


class FSDPEngine:
    def __init__(self, model):
        self.model = model
        self.model_type = model.config.model_type

    def _prepare_mb_list(self, seqs):
        mb = pad_mb(pack_tensor_dict(seqs))
        mb["input_ids"] = mb["input_ids"].unsqueeze(0)
        mb["position_ids"] = mb["position_ids"].unsqueeze(0)
        mb["max_length_q"] = mb["max_length_k"] = mb["max_seqlen"]
        mb["cu_seq_lens_q"] = mb["cu_seq_lens_k"] = mb["cu_seqlens"]
        mb["use_cache"] = False
        if FIXED or is_qwen3_moe_model(self.model_type):
            mb["attention_mask"] = None
        else:
            mb["attention_mask"] = dict(full_attention=None, sliding_attention=None)
        return mb

    @torch.no_grad()
    def compute_logp(self, seqs):
        mb = self._prepare_mb_list(seqs)
        cu_seqlens = mb.pop("cu_seqlens")
        mb.pop("max_seqlen")
        logits = self.model(**mb).logits.squeeze(0)
        labels = torch.roll(mb["input_ids"].squeeze(0), shifts=-1)
        logp = torch.gather(logits.log_softmax(-1), -1, labels.unsqueeze(-1)).squeeze(-1)
        # per-sequence next-token logps, dropping the last position of each sequence
        return [logp[cu_seqlens[i]: cu_seqlens[i + 1] - 1] for i in range(len(seqs))]


def main():
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).eval()
    engine = FSDPEngine(model)

    # prompt + response rollouts of a GRPO group, packed into one micro-batch
    seqs = [[3, 4, 5, 6, 20, 21, 22], [7, 8, 9, 23, 24, 25, 26, 27], [10, 11, 12, 13, 14, 28, 29]]
    packed = engine.compute_logp(seqs)

    diffs = []
    with torch.no_grad():
        for seq, lp in zip(seqs, packed):
            ids = torch.tensor([seq])
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            ref = torch.gather(logits.log_softmax(-1), -1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
            diffs.append((lp - ref).abs().max().item())
    print(f"fixed={FIXED} max |packed logp - single-sequence logp| per sequence = "
          + ", ".join(f"{d:.3e}" for d in diffs))


if __name__ == "__main__":
    main()
