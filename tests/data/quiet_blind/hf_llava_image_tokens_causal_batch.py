"""transformers LLaVA (random weights): image placeholder tokens inside a causal prompt, padded batch.

Follows huggingface/transformers src/transformers/models/llava/modeling_llava.py (LlavaForConditionalGeneration:
CLIP vision tower, `vision_feature_layer`, `vision_feature_select_strategy="default"` drops CLS, projector output
scattered into the positions of `image_token_id`) and the LlavaProcessor convention of expanding `<image>` to one
token per patch. LLaVA, unlike Gemma 3 / PaliGemma, keeps the language model's plain causal mask over image
tokens too.

Masks meant:
- CLIP vision tower: full bidirectional attention over the 1 + 4 patch tokens of each image (no mask);
- language model: causal over the whole sequence, image patches included (patch i sees earlier patches only),
  and the right padding of the shorter row hidden by `attention_mask`.
"""
import torch
from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

IMAGE = 90


def main():
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                         vision_feature_select_strategy="default", vision_feature_layer=-2)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()

    patches = (vision.image_size // vision.patch_size) ** 2
    rows = [
        [1, 10, 11] + [IMAGE] * patches + [12, 13, 14, 15],
        [1, 20] + [IMAGE] * patches + [21],
    ]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    pixel_values = torch.randn(2, 3, vision.image_size, vision.image_size)

    labels = input_ids.masked_fill((input_ids == IMAGE) | (attention_mask == 0), -100)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values, labels=labels)
    print(f"loss {out.loss.item():.4f}, logits {tuple(out.logits.shape)}")


if __name__ == "__main__":
    main()
