"""The Code2Wav vocoder: the network (vocoder.py), its stateful streaming form (stateful.py), CUDA-graph replay of
short calls (graphs.py) and one interface over torch, ONNX Runtime and TensorRT (runtime.py). How a stream is cut
into chunks and decoded is ``omni_triton.pipeline.code2wav``."""
