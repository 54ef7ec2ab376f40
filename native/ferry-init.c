/*
 * ferry-init: start a job in its own PID namespace with a tiny PID 1.
 *
 *   ferry-init CMD [ARGS...]
 *
 * The process the agent spawns unshares a PID namespace and forks; the child
 * is PID 1 there. PID 1 becomes the session leader (CRIU refuses to dump a
 * namespace whose session leader lives outside it), runs CMD as its child,
 * reaps every orphan and exits with CMD's status. Dumping PID 1's tree
 * captures the whole job; a restored copy gets a fresh namespace, so it can
 * run beside its frozen source on the same host.
 *
 * The outer process stays in the agent's namespace only to forward SIGTERM
 * and SIGINT and to hand the status back to the agent.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile pid_t forward_to = -1;

static void forward(int sig)
{
	if (forward_to > 0)
		kill(forward_to, sig);
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

static int run_as_pid1(char **argv)
{
	pid_t job;
	int status;

	if (setsid() < 0) {
		perror("ferry-init: setsid");
		return 127;
	}
	job = fork();
	if (job < 0) {
		perror("ferry-init: fork");
		return 127;
	}
	if (job == 0) {
		signal(SIGTERM, SIG_DFL);
		signal(SIGINT, SIG_DFL);
		execvp(argv[0], argv);
		fprintf(stderr, "ferry-init: cannot run %s: %s\n", argv[0], strerror(errno));
		_exit(127);
	}
	forward_to = job;
	/* PID 1 reaps every orphan in the namespace; it exits with the job. */
	for (;;) {
		pid_t pid = waitpid(-1, &status, 0);

		if (pid == job)
			return status_code(status);
		if (pid < 0 && errno != EINTR)
			return 1;
	}
}

int main(int argc, char **argv)
{
	struct sigaction sa;
	pid_t init;

	if (argc < 2) {
		fprintf(stderr, "usage: ferry-init CMD [ARGS...]\n");
		return 2;
	}
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = forward;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);

	if (unshare(CLONE_NEWPID) < 0) {
		fprintf(stderr, "ferry-init: cannot create a PID namespace: %s (run the agent as root)\n",
			strerror(errno));
		return 126;
	}
	init = fork();
	if (init < 0) {
		perror("ferry-init: fork");
		return 126;
	}
	if (init == 0)
		return run_as_pid1(argv + 1);
	forward_to = init;
	return wait_for(init);
}
