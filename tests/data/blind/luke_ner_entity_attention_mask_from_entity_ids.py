# studio-ousia/luke#172 (commit f8cd0b4): the NER feature extractor built
# entity_attention_mask as `entity_ids != 0`, but the reader fills every candidate span with the
# tokenizer's [MASK] entity id, and pads with a hard-coded 0; with an entity vocab whose [MASK] id
# is 0 every real span entity is masked out.  Fix: the reader emits entity_attention_mask and pads
# entity_ids with the vocab's [PAD] id.
import sys
from typing import Dict

import numpy as np
import torch
from torch import nn
from transformers import LukeConfig, LukeModel

FIXED = "--fixed" in sys.argv

# a "lite" entity vocab that keeps only the special entities
ENTITY_VOCAB = {"[MASK]": 0, "[MASK2]": 1, "[PAD]": 2, "[UNK]": 3}


class ConllSpanReader:
    def __init__(self, max_mention_length=3):
        self.max_mention_length = max_mention_length
        self.entity_id = ENTITY_VOCAB["[MASK]"]
        self.entity_pad_id = ENTITY_VOCAB["[PAD]"] if FIXED else 0

    def text_to_fields(self, word_ids):
        starts, ends, entity_ids, entity_position_ids = [], [], [], []
        n = len(word_ids) - 2  # <s> ... </s>
        for s in range(n):
            for e in range(s + 1, min(n, s + self.max_mention_length) + 1):
                starts.append(s + 1)
                ends.append(e)
                entity_ids.append(self.entity_id)
                pos = list(range(s + 1, e + 1))
                entity_position_ids.append(pos + [-1] * (self.max_mention_length - len(pos)))
        fields = {"word_ids": word_ids, "entity_start_positions": starts, "entity_end_positions": ends,
                  "entity_ids": entity_ids, "entity_position_ids": entity_position_ids}
        if FIXED:
            fields["entity_attention_mask"] = [1] * len(entity_ids)
        return fields

    def collate(self, instances):
        L = max(len(i["word_ids"]) for i in instances)
        E = max(len(i["entity_ids"]) for i in instances)
        def pad(x, n, v):
            return x + [v] * (n - len(x))
        batch = {
            "word_ids": {"input_ids": torch.tensor([pad(i["word_ids"], L, 1) for i in instances]),
                         "attention_mask": torch.tensor([pad([1] * len(i["word_ids"]), L, 0) for i in instances])},
            "entity_start_positions": torch.tensor([pad(i["entity_start_positions"], E, 0) for i in instances]),
            "entity_end_positions": torch.tensor([pad(i["entity_end_positions"], E, 0) for i in instances]),
            "entity_ids": torch.tensor([pad(i["entity_ids"], E, self.entity_pad_id) for i in instances]),
            "entity_position_ids": torch.tensor(np.array(
                [pad(i["entity_position_ids"], E, [-1] * self.max_mention_length) for i in instances])),
        }
        if FIXED:
            batch["entity_attention_mask"] = torch.tensor([pad(i["entity_attention_mask"], E, 0) for i in instances])
        return batch


class TokenEntityNERFeatureExtractor(nn.Module):
    def __init__(self, embedder: LukeModel):
        super().__init__()
        self.embedder = embedder

    def forward(self, inputs: Dict[str, torch.Tensor], entity_start_positions, entity_end_positions,
                entity_ids=None, entity_position_ids=None, entity_attention_mask=None):
        inputs["entity_ids"] = entity_ids
        inputs["entity_position_ids"] = entity_position_ids
        if FIXED:
            inputs["entity_attention_mask"] = entity_attention_mask
        else:
            inputs["entity_attention_mask"] = entity_ids != 0

        out = self.embedder(**inputs)
        token_embeddings, entity_embeddings = out.last_hidden_state, out.entity_last_hidden_state
        embedding_size = token_embeddings.size(-1)
        entity_start_positions = entity_start_positions.unsqueeze(-1).expand(-1, -1, embedding_size)
        start_embeddings = torch.gather(token_embeddings, -2, entity_start_positions)
        entity_end_positions = entity_end_positions.unsqueeze(-1).expand(-1, -1, embedding_size)
        end_embeddings = torch.gather(token_embeddings, -2, entity_end_positions)
        return torch.cat([start_embeddings, end_embeddings, entity_embeddings], dim=2)


class ExhaustiveNERModel(nn.Module):
    def __init__(self, feature_extractor, hidden, num_labels=5):
        super().__init__()
        self.feature_extractor = feature_extractor
        self.classifier = nn.Linear(hidden * 3, num_labels)

    def forward(self, word_ids, entity_start_positions, entity_end_positions, entity_ids=None,
                entity_position_ids=None, entity_attention_mask=None):
        feature_vector = self.feature_extractor(dict(word_ids), entity_start_positions, entity_end_positions,
                                                entity_ids, entity_position_ids, entity_attention_mask)
        return self.classifier(feature_vector)


def main():
    torch.manual_seed(0)
    config = LukeConfig(vocab_size=60, entity_vocab_size=len(ENTITY_VOCAB), hidden_size=32, entity_emb_size=16,
                        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=40, use_entity_aware_attention=True,
                        initializer_range=0.2)
    model = ExhaustiveNERModel(TokenEntityNERFeatureExtractor(LukeModel(config)), 32).eval()
    reader = ConllSpanReader()
    sentences = [[0, 11, 23, 35, 47, 2], [0, 14, 26, 2]]  # "<s> w w w w </s>", shorter one padded
    batch = reader.collate([reader.text_to_fields(s) for s in sentences])
    print("entity_attention_mask used:",
          (batch["entity_ids"] != 0).long()[1].tolist() if not FIXED else batch["entity_attention_mask"][1].tolist())
    with torch.no_grad():
        logits = model(**batch)
    print(f"{'fixed' if FIXED else 'buggy'}: span logits of first sentence, first span: "
          f"{logits[0, 0].numpy().round(3)}")


if __name__ == "__main__":
    main()
