# Thin wrapper over meson: `make run` starts kvtier on embedded defaults, `make test` runs the
# whole suite. Both install missing Debian packages and build first.
.PHONY: run test build bench format clean

run:
	bash scripts/run.sh

test:
	bash scripts/test.sh

build:
	bash scripts/setup.sh build

bench: build
	meson test -C build --benchmark -v

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

clean:
	rm -rf build build-asan
