# Thin wrapper over meson: `make run` starts kvtier on embedded defaults (kvtierd's flags in
# ARGS: make run ARGS="--dram-bytes 2G"), `make test` runs the whole suite. Both install missing
# Debian packages and build first: make run only what kvtierd needs, make test the test tools too.
.PHONY: run test build bench format clean gpu-pack

ARGS ?=

run:
	bash scripts/run.sh $(ARGS)

test:
	bash scripts/test.sh

build:
	bash scripts/setup.sh build

bench: build
	meson test -C build --benchmark -v

gpu-pack:
	bash scripts/gpu-pack.sh

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

clean:
	rm -rf build build-asan build-fuzz
