# huggingface/transformers#40800 ("[SAM2] Fix inconsistent results with original implementation with input boxes"):
# Sam2PromptEncoder._embed_boxes built the sparse prompt tokens of a box without the padding point (not_a_point_embed)
# that the original SAM2 appends to every point/box prompt, so the two-way transformer attends over a different token set.
import sys

import torch
from transformers.models.sam2.configuration_sam2 import Sam2MaskDecoderConfig, Sam2PromptEncoderConfig
from transformers.models.sam2.modeling_sam2 import Sam2MaskDecoder, Sam2PromptEncoder

FIXED = "--fixed" in sys.argv


def _embed_boxes_before_fix(self, boxes: torch.Tensor) -> torch.Tensor:
    """Embeds box prompts. (transformers before #40800)"""
    boxes = boxes + 0.5  # Shift to center of pixel
    coords = boxes.view(*boxes.shape[:2], 2, 2)
    corner_embedding = self.shared_embedding(coords, (self.input_image_size, self.input_image_size))
    corner_embedding[:, :, 0, :] += self.point_embed.weight[2]
    corner_embedding[:, :, 1, :] += self.point_embed.weight[3]
    return corner_embedding


def _embed_boxes_after_fix(self, boxes: torch.Tensor) -> torch.Tensor:
    """Embeds box prompts. (transformers after #40800)"""
    boxes = boxes + 0.5  # Shift to center of pixel
    coords = boxes.view(*boxes.shape[:2], 2, 2)
    # add padding point for consistency with the original implementation
    coords = torch.nn.functional.pad(coords, (0, 0, 0, 1), mode="constant", value=0)
    corner_embedding = self.shared_embedding(coords, (self.input_image_size, self.input_image_size))
    corner_embedding[:, :, 0, :] += self.point_embed.weight[2]
    corner_embedding[:, :, 1, :] += self.point_embed.weight[3]
    corner_embedding[:, :, 2, :] = self.not_a_point_embed.weight.expand_as(corner_embedding[:, :, 2, :])
    return corner_embedding


Sam2PromptEncoder._embed_boxes = _embed_boxes_after_fix if FIXED else _embed_boxes_before_fix


def image_wide_positional_embeddings(prompt_encoder):
    # Sam2Model.get_image_wide_positional_embeddings
    size = prompt_encoder.image_embedding_size
    grid = torch.ones(size)
    y_embed = grid.cumsum(dim=0) - 0.5
    x_embed = grid.cumsum(dim=1) - 0.5
    y_embed = y_embed / size[0]
    x_embed = x_embed / size[1]
    positional_embedding = prompt_encoder.shared_embedding(torch.stack([x_embed, y_embed], dim=-1))
    return positional_embedding.permute(2, 0, 1).unsqueeze(0)


def main():
    torch.manual_seed(0)
    hidden = 32
    pe_cfg = Sam2PromptEncoderConfig(hidden_size=hidden, image_size=64, patch_size=16, mask_input_channels=4)
    md_cfg = Sam2MaskDecoderConfig(hidden_size=hidden, mlp_dim=64, num_hidden_layers=2, num_attention_heads=2,
                                   iou_head_hidden_dim=32)
    md_cfg._attn_implementation = "eager"
    prompt_encoder = Sam2PromptEncoder(pe_cfg).eval()
    mask_decoder = Sam2MaskDecoder(md_cfg).eval()

    batch = 2
    h, w = prompt_encoder.image_embedding_size
    image_embeddings = torch.randn(batch, hidden, h, w)
    high_res = [torch.randn(batch, hidden // 8, 4 * h, 4 * w), torch.randn(batch, hidden // 4, 2 * h, 2 * w)]
    image_pe = image_wide_positional_embeddings(prompt_encoder)
    boxes = torch.tensor([[[5.0, 7.0, 40.0, 50.0]], [[12.0, 3.0, 60.0, 33.0]]])  # (batch, nb_boxes=1, 4)

    def decode(sparse, dense):
        masks, iou, _, obj = mask_decoder(
            image_embeddings=image_embeddings, image_positional_embeddings=image_pe,
            sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense,
            multimask_output=True, high_resolution_features=high_res)
        return masks, iou

    with torch.no_grad():
        # the transformers path: input_boxes -> _embed_boxes
        sparse, dense = prompt_encoder(input_points=None, input_labels=None, input_boxes=boxes, input_masks=None)
        masks, iou = decode(sparse, dense)

        # the original SAM2 path: a box is two points labelled 2 and 3, embedded by _embed_points(pad=True)
        box_points = boxes.view(batch, 1, 2, 2)
        box_labels = torch.tensor([[[2, 3]]]).repeat(batch, 1, 1)
        ref_sparse, ref_dense = prompt_encoder(input_points=box_points, input_labels=box_labels,
                                               input_boxes=None, input_masks=None)
        ref_masks, ref_iou = decode(ref_sparse, ref_dense)

    print(f"sparse prompt tokens per box: {sparse.shape[2]} (original SAM2: {ref_sparse.shape[2]})")
    print(f"box-prompt mask logits vs original SAM2 box-as-points path: max|diff| = {(masks - ref_masks).abs().max().item():.6f}")
    print(f"iou scores max|diff| = {(iou - ref_iou).abs().max().item():.6f}")


if __name__ == "__main__":
    main()
