"""Protocol buffers of pdserve (package pdserve.v1): .proto sources and the generated Python next to them."""
