"""A sample's media and text as the model's processor takes them: images (`image`, `processor`),
video clips (`video`), the demo tokenizer (`tokenizer`), and the sample encoder that lays out the
chat template with the image and video tokens (`encoder`)."""
