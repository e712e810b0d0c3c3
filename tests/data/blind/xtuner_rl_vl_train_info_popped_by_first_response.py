# InternLM/xtuner#1664 (commit 3b788230d, "Fix position_ids error with VL Model RL").
#
# xtuner v1 RL trainer, xtuner/v1/train/rl_trainer.py: _prepare_train_data walks a GRPO group (one prompt,
# prompt_repeat_k sampled responses) and builds each response's SequenceContext with get_train_seq_ctx, handing it
# the group's one `multimodal_train_info` dict (the prompt's Qwen3-VL 3-D mrope position_ids (3, 1, n), the
# pixel_values and image_grid_thw).  Before the fix get_train_seq_ctx took them out with dict.pop(), so the first
# response emptied the shared dict; every later response of the group got a SequenceContext with no position_ids
# (the model numbers its tokens 0..n-1 as plain text) and no image.  The fix reads them with dict.get().
#
# Ported small: xtuner's SequenceContext trimmed to what is used here, the trainer's loop trimmed to the seq_ctx, and
# the model a tiny transformers Qwen3VLForConditionalGeneration built from a config (xtuner's Qwen3VL reads the same
# seq_ctx fields).  Each response's per-token log-probs (what the policy loss is built from) are printed.
import sys

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

FIXED = "--fixed" in sys.argv

IMAGE_TOKEN_ID = 60
VISION_START_ID = 59
VISION_END_ID = 58
VIDEO_TOKEN_ID = 57


class SequenceContext:
    # xtuner/v1/data_proto/sequence_context.py, trimmed
    def __init__(self, input_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, device="cpu",
                 position_ids=None, image_grid_thw=None, pixel_values=None):
        self.input_ids = input_ids
        self.cu_seq_lens_q = cu_seq_lens_q
        self.cu_seq_lens_k = cu_seq_lens_k
        self.max_length_q = max_length_q
        self.max_length_k = max_length_k
        self.device = device
        self.position_ids = position_ids
        self.image_grid_thw = image_grid_thw
        self.pixel_values = pixel_values

    @classmethod
    def from_input_ids(cls, input_ids, device="cuda"):
        assert isinstance(input_ids, (list, tuple))
        for ids in input_ids:
            assert ids.shape[0] == 1, "input_ids must have batch size of 1"
        num_tokens = [x.numel() for x in input_ids]
        cu_seq_lens = torch.cumsum(torch.LongTensor([0] + num_tokens), dim=0).to(device).int()
        return cls(
            input_ids=torch.cat(input_ids, dim=1).to(device),
            cu_seq_lens_k=cu_seq_lens,
            cu_seq_lens_q=cu_seq_lens,
            max_length_q=int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max().item()),
            max_length_k=int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max().item()),
            device=device,
        )


def get_train_seq_ctx(input_ids, multimodal_train_info=None, len_response_ids=0):
    seq_ctx = SequenceContext.from_input_ids((input_ids,), device="cpu")
    if multimodal_train_info and len(multimodal_train_info) > 0:
        if FIXED:
            position_ids = multimodal_train_info.get("position_ids")  # (1,n) or (3,1,n)
        else:
            position_ids = multimodal_train_info.pop("position_ids")  # (1,n) or (3,1,n)
        if position_ids is not None and len(position_ids.shape) == 3:
            # qwen3vl needs special handling, the others don't
            max_value = position_ids.max(dim=-1).values  # (3,1)
            response_position_ids = max_value.unsqueeze(-1).expand(-1, -1, len_response_ids) + torch.arange(
                1, len_response_ids + 1, device=max_value.device
            )
            position_ids = torch.cat([position_ids, response_position_ids], dim=-1)
            seq_ctx.position_ids = position_ids
            assert position_ids.size(-1) == input_ids.size(-1)
        if FIXED:
            seq_ctx.pixel_values = multimodal_train_info.get("pixel_values")
            seq_ctx.image_grid_thw = multimodal_train_info.get("image_grid_thw")
        else:
            seq_ctx.pixel_values = multimodal_train_info.pop("pixel_values")
            seq_ctx.image_grid_thw = multimodal_train_info.pop("image_grid_thw")
            del multimodal_train_info
    return seq_ctx


def prepare_train_data(data_groups, pack_max_length, multimodal_train_infos=None):
    data_batches = []
    is_multimodal = bool(multimodal_train_infos) and len(multimodal_train_infos) > 0
    for j, group in enumerate(data_groups):
        multimodal_train_info = multimodal_train_infos[j] if is_multimodal else None
        prompt_ids = group["train_prompt_ids"]
        for i, response_ids in enumerate(group["response_ids"]):
            input_ids = prompt_ids + response_ids[:-1]
            shifted_labels = [-100] * (len(prompt_ids) - 1) + response_ids
            assert len(input_ids) <= pack_max_length, f"{len(input_ids)} vs {pack_max_length}"
            input_ids = torch.tensor(input_ids, dtype=torch.int64).unsqueeze(0)
            shifted_labels = torch.tensor(shifted_labels, dtype=torch.int64).unsqueeze(0)
            seq_ctx = get_train_seq_ctx(input_ids, multimodal_train_info, len(response_ids) - 1)
            data_batches.append({"seq_ctx": seq_ctx, "shifted_labels": shifted_labels, "response": i})
    return data_batches


def build_model():
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0],
        ),
        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
    )
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).eval()


def main():
    model = build_model()
    g = torch.Generator().manual_seed(1)
    # one prompt: "<text> <vision_start> 4 image tokens <vision_end> <text>"; image grid 1 x 4 x 4 patches -> 4 tokens
    image_grid_thw = torch.tensor([[1, 4, 4]])
    n_patches = 16
    pixel_values = torch.randn(n_patches, 3 * 2 * 4 * 4, generator=g)
    prompt_ids = [5, 6, 7, VISION_START_ID] + [IMAGE_TOKEN_ID] * 4 + [VISION_END_ID, 8, 9, 10]
    mm_token_type_ids = torch.tensor([[1 if t == IMAGE_TOKEN_ID else 0 for t in prompt_ids]])
    with torch.no_grad():
        prompt_position_ids, _ = model.model.get_rope_index(
            torch.tensor([prompt_ids]), mm_token_type_ids, image_grid_thw=image_grid_thw
        )  # (3, 1, n)

    responses = [
        torch.randint(11, 50, (6,), generator=g).tolist(),
        torch.randint(11, 50, (5,), generator=g).tolist(),
        torch.randint(11, 50, (7,), generator=g).tolist(),
    ]
    data_groups = [{"train_prompt_ids": prompt_ids, "response_ids": responses}]
    multimodal_train_infos = [
        {"position_ids": prompt_position_ids, "pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    ]
    data_batches = prepare_train_data(data_groups, pack_max_length=64, multimodal_train_infos=multimodal_train_infos)

    for data in data_batches:
        seq_ctx = data["seq_ctx"]
        input_ids = seq_ctx.input_ids
        mm_types = (input_ids == IMAGE_TOKEN_ID).int()
        with torch.no_grad():
            out = model(
                input_ids=input_ids,
                position_ids=seq_ctx.position_ids,
                pixel_values=seq_ctx.pixel_values,
                image_grid_thw=seq_ctx.image_grid_thw,
                mm_token_type_ids=mm_types if seq_ctx.image_grid_thw is not None else None,
            )
        labels = data["shifted_labels"]
        keep = labels != -100
        logps = torch.log_softmax(out.logits.float(), dim=-1)
        token_logps = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep]
        print(f"response {data['response']}: mean logp {token_logps.mean().item():.6f}")
        print("  ", [round(x, 4) for x in token_logps.tolist()])


if __name__ == "__main__":
    main()
