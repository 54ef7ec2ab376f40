/*
 * ferry-init: start a job in a small world of its own, under a tiny PID 1.
 *
 *   ferry-init [OPTIONS] -- CMD [ARGS...]
 *
 *   --private      own mount namespace (private propagation) with fresh tmpfs
 *                  on /tmp, /dev/shm and /run and a /proc of the job's PID
 *                  namespace: the node's are detached there, so neither the
 *                  job sees them nor CRIU dumps them
 *   --keep PATH    a path under the node's /tmp the job still needs (its code,
 *                  cwd, logs): bound into the fresh /tmp at the same place
 *   --netns        (with --private) own network namespace too, loopback up;
 *                  the agent plumbs the job's link into it during the handshake
 *   --logs DIR     (with --private) the job's log directory, bound at
 *                  /run/ferry-job in its mount namespace; PID 1 opens
 *                  stdout.log and stderr.log there as stdout and stderr, with
 *                  /dev/null as stdin, and closes every inherited fd: CRIU
 *                  cannot dump a file of another mount namespace, and it
 *                  treats /run/ferry-job as an external mount, which each
 *                  node binds to its own copy of the logs
 *   --sync-fd N    PID 1 writes "ready PID\n" on fd N once its namespaces
 *                  exist, then waits for "go\n" (anything else, or EOF:
 *                  exit 126) before it runs CMD; the agent plumbs the network
 *                  in between
 *   (with --private, PID 1 also writes CMD's exit status to exit-status in the
 *   log directory when CMD ends: an agent that restarted meanwhile is no
 *   longer its parent and could not learn it otherwise)
 *   --no-io-uring  a seccomp filter makes io_uring_setup fail with ENOSYS for
 *                  the whole job: CRIU cannot dump io_uring, and libraries that
 *                  try it (libuv, behind torchrun's store) fall back
 *
 * The process the agent spawns unshares a PID namespace and forks; the child
 * is PID 1 there. PID 1 becomes the session leader (CRIU refuses to dump a
 * namespace whose session leader lives outside it), runs CMD as its child,
 * reaps every orphan and exits with CMD's status. Dumping PID 1's tree
 * captures the whole job with its namespaces; a restored copy gets fresh
 * ones, so it can run beside its frozen source on the same host.
 *
 * The outer process stays in the agent's namespaces only to forward SIGTERM
 * and SIGINT and to hand the status back to the agent.
 *
 * PID 1 is also the job's fencing watchdog (docs/recovery.md): an agent with
 * [coordination] sends it FENCE_SIGNAL by sigqueue at every lease renewal, its
 * value the milliseconds left to the agent's own fencing deadline (-1: no
 * watchdog). When they run out with no newer word, as when the agent died and
 * its lease is running out, PID 1 stops every other process of the job; the
 * next word lets them go on. Until a first word it does nothing.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#else
#error "ferry-init: add this architecture's AUDIT_ARCH"
#endif
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif

#define MAX_KEEP 32

struct opts {
	int private_ns;
	int netns;
	int nkeep;
	const char *keep[MAX_KEEP]; /* paths under /tmp the job still sees in its fresh /tmp */
	int as_pid1; /* --as-pid1: the re-exec inside our namespaces */
	const char *self; /* our own path, resolved before the namespaces hide anything */
	int no_io_uring;
	int sync_fd;
	const char *logs;
	char **argv;
};

static volatile pid_t forward_to = -1;

#define FENCE_SIGNAL (SIGRTMIN + 4)
#define TICK_MS 100
static volatile long fence_left_ms = -1; /* -1: disarmed */
static volatile int stopped_by_watchdog;
static struct timespec last_tick;

/*
 * Time is counted from tick to tick, each step capped at a second, never read as a deadline: a
 * copy restored on another node carries its source's clock, and time spent frozen for a move
 * (its ticks held pending) must not count against the node that runs it next.
 */
static void on_tick(int sig)
{
	struct timespec now;
	long step;

	(void)sig;
	clock_gettime(CLOCK_MONOTONIC, &now);
	step = (now.tv_sec - last_tick.tv_sec) * 1000 + (now.tv_nsec - last_tick.tv_nsec) / 1000000;
	last_tick = now;
	if (step < 0 || step > 1000)
		step = TICK_MS;
	if (fence_left_ms < 0)
		return;
	fence_left_ms = fence_left_ms > step ? fence_left_ms - step : 0;
	if (fence_left_ms == 0 && !stopped_by_watchdog) {
		stopped_by_watchdog = 1;
		kill(-1, SIGSTOP); /* every process of the namespace but PID 1 */
	}
}

static void on_word(int sig, siginfo_t *si, void *ctx)
{
	(void)sig;
	(void)ctx;
	if (si->si_code != SI_QUEUE)
		return;
	clock_gettime(CLOCK_MONOTONIC, &last_tick);
	fence_left_ms = si->si_value.sival_int < 0 ? -1 : si->si_value.sival_int;
	if (stopped_by_watchdog && fence_left_ms != 0) {
		stopped_by_watchdog = 0;
		kill(-1, SIGCONT);
	}
}

/* The ticks start with the first word, outside the handler: a job never watched never ticks. */
static int tick_if_armed(void)
{
	static int ticking;
	struct itimerval every = {{0, TICK_MS * 1000}, {0, TICK_MS * 1000}};

	if (ticking || fence_left_ms < 0)
		return 0;
	ticking = 1;
	return setitimer(ITIMER_REAL, &every, NULL); /* not inherited by the job: fork drops it */
}

static int start_watchdog(void)
{
	struct sigaction sa;

	clock_gettime(CLOCK_MONOTONIC, &last_tick);
	memset(&sa, 0, sizeof(sa));
	sa.sa_flags = SA_RESTART;
	sigaddset(&sa.sa_mask, FENCE_SIGNAL); /* the two handlers never interleave */
	sa.sa_handler = on_tick;
	if (sigaction(SIGALRM, &sa, NULL) < 0)
		return -1;
	sa.sa_flags = SA_SIGINFO; /* no SA_RESTART: PID 1's wait returns, and starts the ticks */
	sigemptyset(&sa.sa_mask);
	sigaddset(&sa.sa_mask, SIGALRM);
	sa.sa_sigaction = on_word;
	return sigaction(FENCE_SIGNAL, &sa, NULL);
}

static void forward(int sig)
{
	if (forward_to > 0)
		kill(forward_to, sig);
}

/*
 * SIGTERM and SIGINT wait, blocked, until there is someone to forward them to. A namespace's
 * PID 1 gets no signal it has no handler for, and an exec resets handlers (not the mask, nor
 * what is pending), so the re-exec inside the namespaces would otherwise drop `ferry stop`'s
 * SIGTERM before the job ever saw it.
 */
static void hold_stop_signals(void)
{
	sigset_t stop;

	sigemptyset(&stop);
	sigaddset(&stop, SIGTERM);
	sigaddset(&stop, SIGINT);
	sigprocmask(SIG_BLOCK, &stop, NULL);
}

static void forward_stop_signals(void)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = forward;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
}

static void let_stop_signals_through(void)
{
	sigset_t stop;

	sigemptyset(&stop);
	sigaddset(&stop, SIGTERM);
	sigaddset(&stop, SIGINT);
	sigprocmask(SIG_UNBLOCK, &stop, NULL);
}

static int status_code(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return 1;
}

/* Wait for pid, retrying on EINTR; returns its exit code. */
static int wait_for(pid_t pid)
{
	int status;

	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			return 1;
	}
	return status_code(status);
}

static int fail(const char *what)
{
	fprintf(stderr, "ferry-init: %s: %s\n", what, strerror(errno));
	return 126;
}

/* io_uring_setup fails with ENOSYS; every other call is allowed (native and x32 alike). */
static int deny_io_uring(void)
{
	struct sock_filter filter[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_ARCH, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_STMT(BPF_ALU | BPF_AND | BPF_K, ~0x40000000u), /* the x32 bit */
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { .len = sizeof(filter) / sizeof(filter[0]), .filter = filter };

	return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

static int loopback_up(void)
{
	struct ifreq ifr;
	int sk = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	int ret;

	if (sk < 0)
		return -1;
	memset(&ifr, 0, sizeof(ifr));
	strcpy(ifr.ifr_name, "lo");
	ret = ioctl(sk, SIOCGIFFLAGS, &ifr);
	if (ret == 0) {
		ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
		ret = ioctl(sk, SIOCSIFFLAGS, &ifr);
	}
	close(sk);
	return ret;
}

static int under(const char *path, const char *dir);

/* mountinfo writes space, tab, newline and backslash as \ooo. */
static void unescape(char *s)
{
	char *out = s;

	while (*s) {
		if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' && s[3] >= '0' &&
		    s[3] <= '7') {
			*out++ = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
			s += 4;
		} else {
			*out++ = *s++;
		}
	}
	*out = '\0';
}

static int deeper_first(const void *a, const void *b)
{
	return (int)(strlen(*(char *const *)b) - strlen(*(char *const *)a));
}

/*
 * Detach every mount at path or below it (in our own namespace only): the node's contents
 * there must neither be seen by the job nor dumped by CRIU with it (an `ip netns` mount under
 * /run, say, which CRIU cannot dump). Deepest first, in passes: a mount hidden under another
 * (a tmpfs mounted over /run) can be reached by its path only once the upper one is gone.
 */
static void detach_all(const char *path)
{
	char line[8192], *points[512];
	int pass, i;

	for (pass = 0; pass < 8; pass++) {
		size_t n = 0, k, gone = 0;
		FILE *f = fopen("/proc/self/mountinfo", "re");

		while (f != NULL && n < sizeof(points) / sizeof(points[0]) && fgets(line, sizeof(line), f)) {
			char *field = line;

			for (i = 0; i < 4 && field != NULL; i++) { /* the 5th field: the mount point */
				field = strchr(field, ' ');
				if (field != NULL)
					field++;
			}
			if (field == NULL)
				continue;
			field[strcspn(field, " ")] = '\0';
			unescape(field);
			if (under(field, path) && (points[n] = strdup(field)) != NULL)
				n++;
		}
		if (f != NULL)
			fclose(f);
		qsort(points, n, sizeof(points[0]), deeper_first);
		for (k = 0; k < n; k++) {
			if (umount2(points[k], MNT_DETACH) == 0)
				gone++;
			free(points[k]);
		}
		if (n == 0 || gone == 0)
			return;
	}
}

static int under(const char *path, const char *dir)
{
	size_t n = strlen(dir);

	return strncmp(path, dir, n) == 0 && (path[n] == '/' || path[n] == '\0');
}

static int mkdirs(char *path)
{
	char *p;

	for (p = path + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(path, 0755) < 0 && errno != EEXIST)
			return -1;
		*p = '/';
	}
	return mkdir(path, 0755) < 0 && errno != EEXIST ? -1 : 0;
}

static int tmpfs_at(const char *path, const char *opts)
{
	if (mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts) == 0)
		return 0;
	fprintf(stderr, "ferry-init: cannot mount a tmpfs on %s: %s\n", path, strerror(errno));
	return 126;
}

/*
 * Our own mount namespace (and network namespace, with --netns), in steps that never lose
 * what the job needs:
 *   0. /proc: the node's detached, one of the job's PID namespace mounted (own_proc);
 *   1. /dev/shm: the node's detached, a fresh tmpfs; it also holds the staging below.
 *   2. the new /run and /tmp are built in /dev/shm: /run with the log directory bound at
 *      LOG_MOUNT, /tmp with every --keep path bound at its place;
 *   3. the node's /run and /tmp are detached and the new ones moved into place;
 *   4. stdio opened through LOG_MOUNT.
 * Detached, the node's mounts are neither seen by the job nor dumped by CRIU with it. Every fd
 * inherited from the agent's mount namespace is closed afterwards (see private_stdio).
 */
#define LOG_MOUNT "/run/ferry-job"

static int bind_fd(int fd, const char *dst)
{
	char src[64];

	snprintf(src, sizeof(src), "/proc/self/fd/%d", fd);
	return mount(src, dst, NULL, MS_BIND | MS_REC, NULL);
}

static int stage_dir(const char *path, const char *opts)
{
	if (mkdir(path, 0700) < 0 && errno != EEXIST)
		return fail("cannot stage the job's mounts");
	return tmpfs_at(path, opts);
}

/*
 * A /proc of the job's own PID namespace in place of the node's: in the node's, /proc/<getpid()>
 * names another process (PID 1 here is the node's init there), which confuses what reads its
 * own entries by PID (the CUDA driver among them, by the first device check), and every process
 * of the node is listed to the job. Mounted by PID 1 of the new namespace, so it is that
 * namespace's; the node's /proc and its submounts are detached first, so CRIU dumps one proc
 * mount, which it mounts fresh in the restored namespace.
 */
static int own_proc(void)
{
	detach_all("/proc");
	if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) == 0)
		return 0;
	fprintf(stderr, "ferry-init: cannot mount the job's own /proc: %s\n", strerror(errno));
	return 126;
}

static int private_world(const struct opts *o, int stdio[3])
{
	static const char run_stage[] = "/dev/shm/.ferry-run", tmp_stage[] = "/dev/shm/.ferry-tmp";
	const char *paths[3] = { "/dev/null", LOG_MOUNT "/stdout.log", LOG_MOUNT "/stderr.log" };
	int flags[3] = { O_RDONLY, O_WRONLY | O_APPEND, O_WRONLY | O_APPEND };
	int keep_fd[MAX_KEEP];
	char dst[4096];
	int i, ret, logs;

	for (i = 0; i < o->nkeep; i++) {
		if (under(o->keep[i], "/run") || under(o->keep[i], "/dev/shm") || !under(o->keep[i], "/tmp") ||
		    strcmp(o->keep[i], "/tmp") == 0) {
			fprintf(stderr, "ferry-init: --keep %s: only paths below /tmp can be kept\n", o->keep[i]);
			return 126;
		}
	}
	if (unshare(CLONE_NEWNS | (o->netns ? CLONE_NEWNET : 0)) < 0)
		return fail("cannot create the job's namespaces");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		return fail("cannot make the job's mounts private");
	if ((ret = own_proc()) != 0)
		return ret;
	/* Held by fd from here: the paths may lie on mounts that are detached below. */
	logs = open(o->logs, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (logs < 0) {
		fprintf(stderr, "ferry-init: cannot open the log directory %s: %s\n", o->logs, strerror(errno));
		return 126;
	}
	for (i = 0; i < o->nkeep; i++) {
		keep_fd[i] = open(o->keep[i], O_PATH | O_CLOEXEC);
		if (keep_fd[i] < 0) {
			fprintf(stderr, "ferry-init: cannot keep %s: %s\n", o->keep[i], strerror(errno));
			return 126;
		}
	}
	if (under(o->logs, "/dev/shm")) {
		fprintf(stderr, "ferry-init: the log directory %s lies under /dev/shm, which the job gets fresh\n",
			o->logs);
		return 126;
	}
	detach_all("/dev/shm");
	if ((ret = tmpfs_at("/dev/shm", "mode=1777")) != 0)
		return ret;
	if ((ret = stage_dir(run_stage, "mode=0755")) != 0 || (ret = stage_dir(tmp_stage, "mode=1777")) != 0)
		return ret;
	snprintf(dst, sizeof(dst), "%s%s", run_stage, LOG_MOUNT + strlen("/run"));
	if (mkdir(dst, 0700) < 0 || bind_fd(logs, dst) < 0)
		return fail("cannot bind the job's log directory");
	for (i = 0; i < o->nkeep; i++) {
		snprintf(dst, sizeof(dst), "%s%s", tmp_stage, o->keep[i] + strlen("/tmp"));
		if (mkdirs(dst) < 0 || bind_fd(keep_fd[i], dst) < 0) {
			fprintf(stderr, "ferry-init: cannot keep %s in the job's /tmp: %s\n", o->keep[i],
				strerror(errno));
			return 126;
		}
		close(keep_fd[i]);
	}
	close(logs);
	detach_all("/run");
	detach_all("/tmp");
	if (mount(run_stage, "/run", NULL, MS_MOVE, NULL) < 0 || mount(tmp_stage, "/tmp", NULL, MS_MOVE, NULL) < 0)
		return fail("cannot move the job's /run and /tmp into place");
	rmdir(run_stage);
	rmdir(tmp_stage);
	for (i = 0; i < 3; i++) {
		stdio[i] = open(paths[i], flags[i] | O_NOCTTY | O_CLOEXEC);
		if (stdio[i] < 0) {
			fprintf(stderr, "ferry-init: cannot open %s: %s\n", paths[i], strerror(errno));
			return 126;
		}
	}
	if (o->netns && loopback_up() < 0)
		return fail("cannot bring up the job's loopback");
	return 0;
}

/* Tell the agent where we are, and wait for its word. */
static int handshake(int fd)
{
	char buf[16] = "";
	ssize_t n;
	size_t got = 0;

	dprintf(fd, "ready %d\n", (int)getpid()); /* our PID in our namespace: 1 */
	while (got < 3) {
		n = read(fd, buf + got, 3 - got);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	close(fd);
	if (got != 3 || memcmp(buf, "go\n", 3) != 0) {
		fprintf(stderr, "ferry-init: the agent did not release the job\n");
		return 126;
	}
	return 0;
}

/* The stdio opened in our namespaces becomes 0, 1, 2; every other fd is closed. */
static int private_stdio(const int stdio[3])
{
	int fd, i;

	for (i = 0; i < 3; i++) {
		if (dup2(stdio[i], i) < 0) /* the copy does not inherit O_CLOEXEC */
			return fail("dup2");
	}
	if (syscall(SYS_close_range, 3, ~0U, 0) < 0) {
		DIR *d = opendir("/proc/self/fd");
		struct dirent *e;

		if (d == NULL)
			return fail("cannot list open fds");
		while ((e = readdir(d)) != NULL) {
			fd = atoi(e->d_name);
			if (fd > 2 && fd != dirfd(d))
				close(fd);
		}
		closedir(d);
	}
	return 0;
}

/*
 * PID 1 execs itself again once it is in its own mount namespace: what it had mapped
 * (this binary, libc) lives in the agent's mount namespace, which CRIU cannot dump
 * ("Can't lookup mount"); after the exec every mapping is the job's own.
 */
static int reexec_inside(const struct opts *o)
{
	size_t n = 0, k = 0;
	char **argv;

	while (o->argv[n] != NULL)
		n++;
	argv = calloc(n + 5, sizeof(char *));
	if (argv == NULL)
		return fail("calloc");
	argv[k++] = (char *)o->self;
	argv[k++] = "--as-pid1";
	if (o->no_io_uring)
		argv[k++] = "--no-io-uring";
	argv[k++] = "--";
	memcpy(argv + k, o->argv, n * sizeof(char *));
	execv(o->self, argv);
	fprintf(stderr, "ferry-init: cannot re-run %s inside the job's namespaces: %s (it must not live "
			"under /tmp, /dev/shm or /run, which the job gets fresh)\n",
		o->self, strerror(errno));
	return 126;
}

/* CMD's status, durably, where the agent reads it (the job's log directory, bound here). */
static void record_status(int code)
{
	char text[16];
	int fd, n = snprintf(text, sizeof(text), "%d\n", code);

	fd = open(LOG_MOUNT "/exit-status.tmp", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return;
	if (write(fd, text, n) == n && fsync(fd) == 0) {
		close(fd);
		if (rename(LOG_MOUNT "/exit-status.tmp", LOG_MOUNT "/exit-status") == 0 &&
		    (fd = open(LOG_MOUNT, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) >= 0) {
			fsync(fd);
			close(fd);
		}
		return;
	}
	close(fd);
}

static int run_as_pid1(const struct opts *o)
{
	pid_t job;
	int status, ret, stdio[3];

	if (o->private_ns && !o->as_pid1) {
		if ((ret = private_world(o, stdio)) != 0)
			return ret;
		if (o->sync_fd >= 0 && (ret = handshake(o->sync_fd)) != 0)
			return ret;
		if ((ret = private_stdio(stdio)) != 0)
			return ret;
		return reexec_inside(o);
	}
	if (o->sync_fd >= 0 && (ret = handshake(o->sync_fd)) != 0)
		return ret;
	if (o->no_io_uring && deny_io_uring() < 0)
		return fail("cannot install the io_uring filter");
	if (setsid() < 0)
		return fail("setsid");
	hold_stop_signals(); /* already held since main(); again for a caller that did not */
	forward_stop_signals();
	if (start_watchdog() < 0)
		return fail("cannot start the fencing watchdog");
	job = fork();
	if (job < 0)
		return fail("fork");
	if (job == 0) {
		signal(SIGTERM, SIG_DFL);
		signal(SIGINT, SIG_DFL);
		signal(SIGALRM, SIG_DFL);
		signal(FENCE_SIGNAL, SIG_DFL);
		let_stop_signals_through();
		execvp(o->argv[0], o->argv);
		fprintf(stderr, "ferry-init: cannot run %s: %s\n", o->argv[0], strerror(errno));
		_exit(127);
	}
	forward_to = job;
	let_stop_signals_through(); /* one that came meanwhile reaches the job now */
	/* PID 1 reaps every orphan in the namespace; it exits with the job. */
	for (;;) {
		pid_t pid = waitpid(-1, &status, 0);

		if (pid == job) {
			if (o->as_pid1) /* the re-exec of --private: the log directory is bound here */
				record_status(status_code(status));
			return status_code(status);
		}
		if (pid < 0 && errno != EINTR)
			return 1;
		if (pid < 0 && tick_if_armed() < 0) /* the job goes on: only its watchdog is missing */
			fprintf(stderr, "ferry-init: the fencing watchdog cannot tick: %s\n", strerror(errno));
	}
}

static int usage(const char *why)
{
	fprintf(stderr, "ferry-init: %s\n", why);
	fprintf(stderr, "usage: ferry-init [--private --logs DIR [--netns] [--keep PATH]...] [--sync-fd N] "
			"[--no-io-uring] -- CMD [ARGS...]\n");
	return 2;
}

static int parse(int argc, char **argv, struct opts *o)
{
	int i;

	memset(o, 0, sizeof(*o));
	o->sync_fd = -1;
	for (i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--") == 0) {
			o->argv = argv + i + 1;
			break;
		} else if (strcmp(argv[i], "--private") == 0) {
			o->private_ns = 1;
		} else if (strcmp(argv[i], "--netns") == 0) {
			o->netns = 1;
		} else if (strcmp(argv[i], "--keep") == 0 && i + 1 < argc) {
			if (o->nkeep == MAX_KEEP)
				return usage("too many --keep paths");
			if (argv[i + 1][0] != '/')
				return usage("--keep takes an absolute path");
			o->keep[o->nkeep++] = argv[++i];
		} else if (strcmp(argv[i], "--as-pid1") == 0) {
			o->as_pid1 = 1;
		} else if (strcmp(argv[i], "--no-io-uring") == 0) {
			o->no_io_uring = 1;
		} else if (strcmp(argv[i], "--logs") == 0 && i + 1 < argc) {
			o->logs = argv[++i];
		} else if (strcmp(argv[i], "--sync-fd") == 0 && i + 1 < argc) {
			char *end;

			o->sync_fd = (int)strtol(argv[++i], &end, 10);
			if (*end || o->sync_fd < 3)
				return usage("--sync-fd takes an fd number of 3 or more");
		} else {
			return usage("unknown option (options come before --)");
		}
	}
	if (o->argv == NULL || o->argv[0] == NULL)
		return usage("no command after --");
	if (o->private_ns && (o->logs == NULL || o->logs[0] != '/'))
		return usage("--private needs --logs DIR, an absolute path");
	if (o->netns && !o->private_ns)
		return usage("--netns needs --private");
	return 0;
}

/* Our own path, absolute, while the agent's mount namespace still shows it. */
static const char *self_path(void)
{
	static char buf[4096];
	ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);

	if (n <= 0)
		return NULL;
	buf[n] = '\0';
	return buf;
}

int main(int argc, char **argv)
{
	struct opts o;
	pid_t init;
	int ret = parse(argc, argv, &o);

	if (ret)
		return ret;
	hold_stop_signals(); /* until the job runs (PID 1) or PID 1 exists (this process) */
	if (o.as_pid1) /* the re-exec: already PID 1 in the job's namespaces */
		return run_as_pid1(&o);
	o.self = self_path();
	if (o.private_ns && o.self == NULL)
		return fail("cannot read /proc/self/exe");
	forward_stop_signals();

	if (unshare(CLONE_NEWPID) < 0) {
		fprintf(stderr, "ferry-init: cannot create a PID namespace: %s (run the agent as root)\n",
			strerror(errno));
		return 126;
	}
	init = fork();
	if (init < 0)
		return fail("fork");
	if (init == 0)
		return run_as_pid1(&o);
	if (o.sync_fd >= 0)
		close(o.sync_fd);
	forward_to = init;
	let_stop_signals_through();
	return wait_for(init);
}
