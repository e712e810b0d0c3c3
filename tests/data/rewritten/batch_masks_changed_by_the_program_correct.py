# Correct programs that run one model twice over the same batch, the mask in it changed or rewritten in ways that are
# not the model's forward narrowing it: a token-dropout augmentation the training loop applies to the batch between
# two passes (the program's own choice), a forward that writes back the same mask as bool (no token dropped), a
# forward that keeps its pooling mask in another field of the batch, and a forward that narrows the mask of a batch
# that is never run again.
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

torch.manual_seed(0)

config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=32)
config._attn_implementation = "eager"
bert = BertModel(config, add_pooling_layer=False).eval()


class Embedder(torch.nn.Module):
    def __init__(self, model, mode):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, features):
        hidden = self.model(input_ids=features["input_ids"], attention_mask=features["attention_mask"]).last_hidden_state
        mask = features["attention_mask"].clone()
        mask[:, :2] = 0  # the prompt left out of the pooling
        if self.mode == "cast":
            features["attention_mask"] = features["attention_mask"].bool()
        elif self.mode == "other-field":
            features["pooling_mask"] = mask
        elif self.mode == "once":
            features["attention_mask"] = mask
        weights = mask.unsqueeze(-1).float()
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def features():
    ids = torch.tensor([[1, 7, 8, 9, 10, 2, 0], [1, 7, 8, 11, 12, 13, 2]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


with torch.no_grad():
    # the training loop's own token dropout between two passes over the same ids
    batch = features()
    plain = Embedder(bert, "keep")
    first = plain(batch)
    keep = torch.ones_like(batch["attention_mask"])
    keep[:, 3] = 0
    batch["attention_mask"] = batch["attention_mask"] * keep
    second = plain(batch)
    # a forward that writes back the mask as bool, or its pooling mask in another field, run twice
    for mode in ("cast", "other-field"):
        batch = features()
        model = Embedder(bert, mode)
        model(batch), model(batch)
    # a forward that narrows the batch's mask, the batch never run again
    once = Embedder(bert, "once")
    once(features())
    once(features())
print("ok", tuple(first.shape), tuple(second.shape))
