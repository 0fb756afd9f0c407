--[[
dlshare: job_submit/lua plugin that holds every job submitted to a partition dlshare schedules.

Install: copy this file beside slurm.conf (Slurm reads job_submit.lua from the directory of
slurm.conf), set  JobSubmitPlugins=lua  in slurm.conf, then  scontrol reconfigure.
Remove:  drop the JobSubmitPlugins line (or this partition from the table below), then
         scontrol reconfigure, and release what is still held (README, "Slurm").

A held job has priority 0; `dlshare slurm` places it (NodeList, CPUs, memory, GPUs) and releases it.
Without this plugin, users submit with  sbatch --hold  instead.
]]

-- The partitions dlshare schedules (one `dlshare slurm` runs per partition).
local DLSHARE_PARTITIONS = { dlshare = true }
-- Hold jobs that name no partition too: set true when a dlshare partition is the default one.
local HOLD_WHEN_NO_PARTITION = false

local function ours(partition)
   if partition == nil or partition == "" then
      return HOLD_WHEN_NO_PARTITION
   end
   for name in string.gmatch(partition, "[^,]+") do
      if DLSHARE_PARTITIONS[name] then
         return true
      end
   end
   return false
end

function slurm_job_submit(job_desc, part_list, submit_uid)
   if ours(job_desc.partition) then
      job_desc.priority = 0
      slurm.log_debug("dlshare: job %s of uid %u held for dlshare", tostring(job_desc.name), submit_uid)
   end
   return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   return slurm.SUCCESS
end

slurm.log_info("dlshare job_submit.lua loaded")
return slurm.SUCCESS
