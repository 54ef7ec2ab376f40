/*
 * A job one of whose threads waits with a page-aligned stack pointer; it holds
 * MiB of memory (argv[1], default 128) that it checks every step.
 *
 * CRIU 4.2.1's lazy dump took every page of such a process for a stack page
 * (is_stack() compared offsets within the page, not pages) and so dumped the
 * whole memory eagerly. tests/integration/test_postcopy.py moves this post-copy
 * and checks that the memory stayed lazy.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static char stack[1 << 16] __attribute__((aligned(4096)));

static void *parked(void *arg)
{
	(void)arg;
	/* pause() for ever on a page-aligned stack: a raw syscall pushes nothing. */
	__asm__ volatile("mov %0, %%rsp\n"
			 "1: mov $34, %%eax\n" /* __NR_pause */
			 "syscall\n"
			 "jmp 1b\n"
			 :
			 : "r"(stack + sizeof(stack))
			 : "rax", "rcx", "r11", "memory");
	return NULL;
}

static unsigned char expected(size_t i)
{
	return (unsigned char)(i * 7 + i / 4096);
}

int main(int argc, char **argv)
{
	size_t n = (size_t)(argc > 1 ? atol(argv[1]) : 128) << 20;
	unsigned char *m = malloc(n);
	pthread_t t;
	struct timespec ts;

	if (!m)
		return 2;
	for (size_t i = 0; i < n; i++)
		m[i] = expected(i);
	if (pthread_create(&t, NULL, parked, NULL))
		return 2;
	printf("ready %zu bytes\n", n);
	fflush(stdout);
	for (unsigned long step = 0;; step++) {
		for (size_t i = 0; i < n; i += 512) {
			if (m[i] != expected(i)) {
				printf("corrupt at %zu\n", i);
				return 3;
			}
		}
		clock_gettime(CLOCK_REALTIME, &ts);
		printf("step %lu t=%ld.%06ld\n", step, (long)ts.tv_sec, ts.tv_nsec / 1000);
		fflush(stdout);
		usleep(100000);
	}
}
