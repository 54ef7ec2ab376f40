/*
 * cuda-counter: a GPU job whose whole state lives in device memory, for
 * ferry's GPU integration tests.
 *
 *   cuda-counter [--steps N] [--step-time SECONDS] [--mib M] [--managed] [--seed S]
 *
 * A step counter and a buffer of M MiB live only on device 0. Every step
 * mixes the buffer, bumps the counter and prints both (the buffer as a
 * checksum), so a checkpoint, restore or migration that lost or corrupted
 * device memory shows up as wrong step lines or a wrong final digest. The
 * output depends only on the arguments: an uninterrupted run and a migrated
 * one print the same lines.
 *
 * --managed allocates the buffer with cudaMallocManaged, which ferry must
 * refuse to migrate.
 *
 * Exit status: 0 done, 1 a CUDA call failed, 2 bad arguments.
 */
#include <cuda_runtime.h>

#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

static void check(cudaError_t err, const char *what)
{
	if (err != cudaSuccess) {
		fprintf(stderr, "cuda-counter: %s failed: %s\n", what, cudaGetErrorString(err));
		exit(1);
	}
}
#define CHECK(call) check((call), #call)
/* Launch errors surface here; errors while running, at the next synchronising call. */
#define CHECK_LAUNCH(name) check(cudaGetLastError(), name "<<<>>>")

/* A fixed launch shape: no result may depend on the GPU's number of SMs. */
static const int kBlocks = 1024;
static const int kThreads = 256;

#define FOR_EACH(i, n) \
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); \
	     i += (size_t)gridDim.x * blockDim.x)

/* splitmix64's finaliser: a cheap, well-mixed function of (seed, index). */
__device__ static uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

__global__ void fill(uint32_t *buf, size_t n, uint64_t seed)
{
	FOR_EACH(i, n)
		buf[i] = (uint32_t)mix64(seed * 0x9e3779b97f4a7c15ULL + i);
}

/* One step: an LCG update of every element (uint32 wrap-around intended), counter += 1. */
__global__ void step_kernel(uint32_t *buf, size_t n, uint32_t step, unsigned long long *counter)
{
	if (blockIdx.x == 0 && threadIdx.x == 0)
		*counter += 1; /* one thread: no atomic needed */
	FOR_EACH(i, n)
		buf[i] = buf[i] * 1664525u + 1013904223u + step;
}

/*
 * *sum += Σ buf[i] * (2i+1) mod 2^64. The weight catches data that moved;
 * addition mod 2^64 commutes, so the order of the atomics cannot change the
 * result.
 */
__global__ void checksum(const uint32_t *buf, size_t n, unsigned long long *sum)
{
	unsigned long long local = 0;

	FOR_EACH(i, n)
		local += (unsigned long long)buf[i] * (2 * i + 1);
	/* Sum the warp first: one atomic per warp, not per thread (kThreads % 32 == 0). */
	for (int off = 16; off > 0; off /= 2)
		local += __shfl_down_sync(0xffffffffu, local, off);
	if (threadIdx.x % 32 == 0)
		atomicAdd(sum, local);
}

/* FNV-1a 64 over the little-endian bytes of v. */
static uint64_t fnv1a(uint64_t h, uint64_t v)
{
	for (int b = 0; b < 8; b++) {
		h ^= (v >> (8 * b)) & 0xff;
		h *= 0x100000001b3ULL;
	}
	return h;
}

/* Sleeps the whole interval even if a signal (e.g. around a checkpoint) cuts it short. */
static void sleep_s(double s)
{
	struct timespec req, rem;

	if (s <= 0)
		return;
	req.tv_sec = (time_t)s;
	req.tv_nsec = (long)((s - (double)req.tv_sec) * 1e9);
	while (nanosleep(&req, &rem) != 0 && errno == EINTR)
		req = rem;
}

static void usage(const char *msg, const char *arg)
{
	fprintf(stderr, "cuda-counter: %s%s\n", msg, arg);
	fprintf(stderr, "usage: cuda-counter [--steps N] [--step-time SECONDS] [--mib M] "
			"[--managed] [--seed S]\n");
	exit(2);
}

/* The whole of s as an unsigned integer, or exit 2. */
static unsigned long long parse_u64(const char *s)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s || *end || s[0] == '-')
		usage("not an unsigned integer: ", s);
	return v;
}

/* The whole of s as a finite, non-negative number of seconds, or exit 2. */
static double parse_seconds(const char *s)
{
	char *end;
	double v = strtod(s, &end);

	if (end == s || *end || !std::isfinite(v) || v < 0)
		usage("not a duration in seconds: ", s);
	return v;
}

int main(int argc, char **argv)
{
	unsigned long long steps = 100, mib = 256, seed = 0;
	double step_time = 0.1;
	bool managed = false;

	for (int a = 1; a < argc; a++) {
		const char *arg = argv[a];

		if (strcmp(arg, "--managed") == 0) {
			managed = true;
			continue;
		}
		if (strcmp(arg, "--steps") && strcmp(arg, "--step-time") && strcmp(arg, "--mib") &&
		    strcmp(arg, "--seed"))
			usage("unknown argument: ", arg);
		if (a + 1 >= argc)
			usage("missing value for ", arg);
		const char *val = argv[++a];
		if (strcmp(arg, "--steps") == 0)
			steps = parse_u64(val);
		else if (strcmp(arg, "--mib") == 0)
			mib = parse_u64(val);
		else if (strcmp(arg, "--seed") == 0)
			seed = parse_u64(val);
		else
			step_time = parse_seconds(val);
	}
	if (mib == 0 || mib > (1ULL << 20))
		usage("--mib must be 1 to 1048576", "");
	if (steps > UINT32_MAX)
		usage("--steps must be at most 4294967295", "");

	const size_t n = (size_t)mib * (1 << 20) / sizeof(uint32_t);
	uint32_t *buf;
	unsigned long long *dev; /* dev[0]: the counter, dev[1]: the current step's checksum */
	unsigned long long host[2];
	uint64_t digest = 0xcbf29ce484222325ULL; /* FNV-1a offset basis */

	CHECK(cudaSetDevice(0));
	if (managed)
		CHECK(cudaMallocManaged(&buf, n * sizeof(uint32_t)));
	else
		CHECK(cudaMalloc(&buf, n * sizeof(uint32_t)));
	CHECK(cudaMalloc(&dev, 2 * sizeof(unsigned long long)));
	CHECK(cudaMemset(dev, 0, 2 * sizeof(unsigned long long)));
	fill<<<kBlocks, kThreads>>>(buf, n, seed);
	CHECK_LAUNCH("fill");
	CHECK(cudaDeviceSynchronize());

	for (unsigned long long i = 0; i < steps; i++) {
		step_kernel<<<kBlocks, kThreads>>>(buf, n, (uint32_t)i, &dev[0]);
		CHECK_LAUNCH("step_kernel");
		CHECK(cudaDeviceSynchronize());
		CHECK(cudaMemset(&dev[1], 0, sizeof(unsigned long long)));
		checksum<<<kBlocks, kThreads>>>(buf, n, &dev[1]);
		CHECK_LAUNCH("checksum");
		/* A plain cudaMemcpy on the default stream waits for checksum. */
		CHECK(cudaMemcpy(host, dev, sizeof(host), cudaMemcpyDeviceToHost));
		digest = fnv1a(digest, host[1]);
		printf("step %llu counter %llu sum %016llx\n", i, host[0], host[1]);
		fflush(stdout); /* the log is read while the job runs and must be whole at a checkpoint */
		sleep_s(step_time);
	}
	/* The counter read afresh, not the last step's copy: also right for --steps 0. */
	CHECK(cudaMemcpy(host, dev, sizeof(host[0]), cudaMemcpyDeviceToHost));
	digest = fnv1a(digest, host[0]);
	printf("final digest %016" PRIx64 "\n", digest);
	fflush(stdout);

	CHECK(cudaFree(buf));
	CHECK(cudaFree(dev));
	return 0;
}
