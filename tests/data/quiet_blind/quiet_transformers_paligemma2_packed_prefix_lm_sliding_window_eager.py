# Correct program (quiet batch quiet-r108a).
# Citation: huggingface/transformers v5.25.0 (the installed release):
#   src/transformers/models/paligemma/modeling_paligemma.py (PaliGemmaModel.forward: 1-indexed position_ids,
#   block_sequence_ids = where(token_type_ids == 0, 0, -1) on the first iteration, create_causal_mask for
#   "full_attention" and create_sliding_window_causal_mask for "sliding_attention" since PaliGemma 2's text model
#   is Gemma 2), src/transformers/masking_utils.py (_preprocess_mask_arguments -> find_packed_sequence_indices when
#   attention_mask is None, remap_positions_for_packed_sequence, blockwise_overlay, packed_sequence_mask_function),
#   src/transformers/models/gemma2/modeling_gemma2.py (Gemma2Model picks the mask by config.layer_types).
# Masking: PaliGemma 2 fine-tuning rows packed padding-free: several examples [image tokens, bos, prompt, \n][answer,
#   eos] are concatenated in one row with no attention_mask, their position_ids restarting at 1. transformers finds
#   the documents from the position_ids, keeps each document's prefix (token_type_ids == 0) bidirectional, its answer
#   causal, and the sliding layers (sliding_window 8, prefixes at most 8 tokens) limited to the last 8 positions.
#   Checked against each example run alone and against a double-loop mask fed to the text model by hand, with eager attention
#   (Gemma 2 refuses SDPA in this release because of its logit softcapping).
import torch
from transformers import Gemma2Config, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

torch.manual_seed(0)

PAD, EOS, BOS, NEWLINE, IMAGE = 0, 1, 2, 3, 99
SLIDING_WINDOW = 8


def build_config():
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                image_size=8, patch_size=4, projection_dim=32)
    text = Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=SLIDING_WINDOW,
                        layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=8,
                        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    config = PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMAGE,
                             projection_dim=32, vocab_size=100)
    config.text_config.vocab_size = 100
    return config


NUM_IMAGE_TOKENS = (8 // 4) ** 2


def tokenize_example(prompt, answer):
    # PaliGemmaProcessor layout: image tokens + bos + prompt + "\n" is the prefix, answer + eos the suffix.
    prefix = [IMAGE] * NUM_IMAGE_TOKENS + [BOS] + prompt + [NEWLINE]
    suffix = answer + [EOS]
    return {
        "input_ids": prefix + suffix,
        "token_type_ids": [0] * len(prefix) + [1] * len(suffix),
        "labels": [-100] * len(prefix) + suffix,
    }


def pack_examples(examples, pixel_values):
    # Padding-free packing: one row, no attention_mask, position_ids restarting (1-indexed, as PaliGemma counts).
    row = {"input_ids": [], "token_type_ids": [], "labels": [], "position_ids": []}
    for ex in examples:
        for key in ("input_ids", "token_type_ids", "labels"):
            row[key] += ex[key]
        row["position_ids"] += list(range(1, len(ex["input_ids"]) + 1))
    batch = {k: torch.tensor([v]) for k, v in row.items()}
    batch["pixel_values"] = torch.cat(pixel_values)
    return batch


def reference_masks(token_type_ids, dtype):
    # One example alone: prefix both ways, suffix causal; sliding layers see keys with q - k < SLIDING_WINDOW.
    n = len(token_type_ids)
    full = torch.full((1, 1, n, n), torch.finfo(dtype).min, dtype=dtype)
    sliding = full.clone()
    for q in range(n):
        for k in range(n):
            visible = k <= q or (token_type_ids[q] == 0 and token_type_ids[k] == 0)
            if visible:
                full[0, 0, q, k] = 0.0
                if abs(q - k) < SLIDING_WINDOW:
                    sliding[0, 0, q, k] = 0.0
    return {"full_attention": full, "sliding_attention": sliding}


def reference_hidden(model, example, pixel_values):
    # The text model fed by hand: image features scattered into the embeddings, masks from the double loop.
    input_ids = torch.tensor([example["input_ids"]])
    embeds = model.model.get_input_embeddings()(input_ids)
    features = model.model.get_image_features(pixel_values).pooler_output
    embeds = embeds.masked_scatter((input_ids == IMAGE).unsqueeze(-1), features.to(embeds.dtype))
    position_ids = torch.arange(1, input_ids.shape[1] + 1).unsqueeze(0)
    out = model.model.language_model(inputs_embeds=embeds, position_ids=position_ids,
                                     attention_mask=reference_masks(example["token_type_ids"], embeds.dtype))
    return out.last_hidden_state[0]


def main():
    config = build_config()
    # Prefixes of at most SLIDING_WINDOW tokens (4 image tokens + bos + prompt + "\n"), answers longer than the window
    # so that the sliding layers drop keys inside each answer.
    examples = [
        tokenize_example([10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28]),
        tokenize_example([12], [30, 31, 32]),
        tokenize_example([13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]),
    ]
    pixel_values = [torch.randn(1, 3, 8, 8) for _ in examples]
    batch = pack_examples(examples, pixel_values)

    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration._from_config(config, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        packed = model(**batch)
        packed_hidden = model.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                                    token_type_ids=batch["token_type_ids"],
                                    position_ids=batch["position_ids"]).last_hidden_state[0]
        start, loss_sum, loss_count = 0, 0.0, 0
        for ex, pv in zip(examples, pixel_values):
            n = len(ex["input_ids"])
            alone = model(input_ids=torch.tensor([ex["input_ids"]]), pixel_values=pv,
                          token_type_ids=torch.tensor([ex["token_type_ids"]]), labels=torch.tensor([ex["labels"]]))
            torch.testing.assert_close(packed.logits[0, start:start + n], alone.logits[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(packed_hidden[start:start + n], reference_hidden(model, ex, pv),
                                       atol=1e-5, rtol=1e-4)
            count = sum(1 for t in ex["labels"][1:] if t != -100)
            loss_sum, loss_count = loss_sum + alone.loss.item() * count, loss_count + count
            start += n
        torch.testing.assert_close(packed.loss.item(), loss_sum / loss_count, atol=1e-5, rtol=1e-5)
    print(f"packed row of {start} tokens matches {len(examples)} examples alone and a "
          f"double-loop mask; loss {packed.loss.item():.4f}")


if __name__ == "__main__":
    main()
