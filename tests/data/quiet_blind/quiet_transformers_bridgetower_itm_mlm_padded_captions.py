# Correct program (quiet batch quiet-r86b).
#
# Citation: huggingface/transformers src/transformers/models/bridgetower/modeling_bridgetower.py (installed 5.25.0:
# BridgeTowerModel.forward, BridgeTowerForImageAndTextRetrieval.forward, BridgeTowerForMaskedLM.forward) and
# processing_bridgetower.py (the RoBERTa tokenizer padding captions to the longest, attention_mask 1 = token).
#
# BridgeTower runs a text tower and a CLIP-style image tower and joins them with bridge layers into a two-stream
# cross-modal encoder: text tokens self-attend (with the caption padding mask) and cross-attend every image patch;
# image patches self-attend freely (the image stream is never padded) and cross-attend the caption with the same
# padding mask as encoder_attention_mask. A batch of images scored against right-padded captions (ITM), and
# masked-token prediction on the same padded batch, must equal each (image, caption) pair run alone, unpadded.
import sys

import torch

from transformers import (
    BridgeTowerConfig,
    BridgeTowerForImageAndTextRetrieval,
    BridgeTowerForMaskedLM,
    BridgeTowerTextConfig,
    BridgeTowerVisionConfig,
)

torch.manual_seed(0)

PAD, BOS, EOS, MASK = 1, 0, 2, 3


def tiny_config():
    text_config = BridgeTowerTextConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    vision_config = BridgeTowerVisionConfig(hidden_size=64, num_hidden_layers=3, patch_size=8, image_size=32)
    return BridgeTowerConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
        text_config=text_config.to_dict(), vision_config=vision_config.to_dict(),
    )


def collate(captions):
    """As the processor pads a batch of captions: right padding with <pad>, attention_mask 1 on tokens."""
    longest = max(len(c) for c in captions)
    input_ids = torch.full((len(captions), longest), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(captions), longest), dtype=torch.long)
    for i, c in enumerate(captions):
        input_ids[i, : len(c)] = torch.tensor(c)
        attention_mask[i, : len(c)] = 1
    return input_ids, attention_mask


def main():
    config = tiny_config()
    itm = BridgeTowerForImageAndTextRetrieval(config).eval()
    mlm = BridgeTowerForMaskedLM(config).eval()

    g = torch.Generator().manual_seed(1)
    captions = [
        [BOS] + torch.randint(5, 40, (n,), generator=g).tolist() + [EOS] for n in (9, 3, 6)
    ]
    captions[1][2] = MASK
    captions[2][4] = MASK
    pixel_values = torch.randn(3, 3, 32, 32, generator=g)
    input_ids, attention_mask = collate(captions)
    pixel_mask = torch.ones(3, 32, 32, dtype=torch.long)

    with torch.no_grad():
        out = itm(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                  pixel_mask=pixel_mask, output_hidden_states=True)
        mlm_out = mlm(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                      pixel_mask=pixel_mask)
        base = itm.bridgetower(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                               pixel_mask=pixel_mask)

        for i, c in enumerate(captions):
            n = len(c)
            ids = torch.tensor([c])
            # Reference: the pair alone, no padding, no mask.
            ref = itm(input_ids=ids, pixel_values=pixel_values[i : i + 1])
            ref_base = itm.bridgetower(input_ids=ids, pixel_values=pixel_values[i : i + 1])
            ref_mlm = mlm(input_ids=ids, pixel_values=pixel_values[i : i + 1])
            assert torch.allclose(out.logits[i], ref.logits[0], atol=1e-5), (i, out.logits[i], ref.logits[0])
            assert torch.allclose(base.text_features[i, :n], ref_base.text_features[0], atol=1e-5), i
            assert torch.allclose(base.image_features[i], ref_base.image_features[0], atol=1e-5), i
            assert torch.allclose(base.pooler_output[i], ref_base.pooler_output[0], atol=1e-5), i
            assert torch.allclose(mlm_out.logits[i, :n], ref_mlm.logits[0], atol=1e-4), i
            if MASK in c:
                p = c.index(MASK)
                assert mlm_out.logits[i, p].argmax() == ref_mlm.logits[0, p].argmax(), i

        # ITM loss on the padded batch equals the mean of per-pair cross entropies (labels: 1 matched, 0 not).
        labels = torch.tensor([1, 0, 1])
        loss = itm(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                   pixel_mask=pixel_mask, labels=labels).loss
        per_pair = []
        for i, c in enumerate(captions):
            logits = itm(input_ids=torch.tensor([c]), pixel_values=pixel_values[i : i + 1]).logits[0]
            per_pair.append(-torch.log_softmax(logits, -1)[labels[i]])
        assert torch.allclose(loss, torch.stack(per_pair).mean(), atol=1e-5), (loss, per_pair)

    print("bridgetower padded captions: ITM logits, loss, cross-modal features and MLM logits match per-pair runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
