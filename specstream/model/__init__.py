"""The target model: resolution and loading, the architectures served, the packed forward (runner), the lean Llama forward and its attention."""
